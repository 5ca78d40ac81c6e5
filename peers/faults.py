"""Fault injection for tests and benchmarks: a stage runtime that is slower than it should be or
fails a fraction of its calls. Only built when a `--fault-*` flag is set, so the normal code path
never branches on it."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from peers.stage_runtime import StageRuntime, ThroughputMeter


class InjectedFault(RuntimeError):
    """A failure injected on purpose (`--fault-fail-rate`)."""


@dataclass(frozen=True)
class FaultSettings:
    slowdown: float = 1.0  # every compute takes this many times as long (extra time is slept)
    fail_rate: float = 0.0  # fraction of calls that fail with an internal error
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.slowdown != 1.0 or self.fail_rate > 0.0

    def __post_init__(self) -> None:
        if self.slowdown < 1.0 or not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("--fault-slowdown must be >= 1 and --fault-fail-rate within [0, 1]")


class FaultyStageRuntime:
    """Wraps a StageRuntime; forwards everything else to it unchanged."""

    def __init__(self, runtime: StageRuntime, settings: FaultSettings):
        self._runtime, self._settings = runtime, settings
        self._rng = random.Random(settings.seed)

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    @property
    def throughput(self) -> ThroughputMeter:
        """What the peer announces: the inner measurement, slowed down as the calls are."""
        return ThroughputMeter(initial=self._runtime.throughput.value / self._settings.slowdown)

    def _run(self, compute, *args, **kwargs):
        if self._rng.random() < self._settings.fail_rate:
            raise InjectedFault("injected failure (--fault-fail-rate)")
        started = time.perf_counter()
        result = compute(*args, **kwargs)
        time.sleep((self._settings.slowdown - 1.0) * (time.perf_counter() - started))
        return result

    def forward(self, microbatch_id: str, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(self._runtime.forward, microbatch_id, inputs, targets)

    def backward(self, microbatch_id: str, inputs: torch.Tensor, **kwargs):
        return self._run(self._runtime.backward, microbatch_id, inputs, **kwargs)
