"""Fault injection for tests and benchmarks: a stage runtime that is slower than it should be,
fails a fraction of its calls, or returns garbage (NaNs, or a wrong shape) while computing
correctly inside. Only built when a `--fault-*` flag is set, so the normal code path never
branches on it."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from peers.stage_runtime import StageRuntime, ThroughputMeter


GARBAGE_KINDS = ("none", "nan", "shape")


def garbled(value, kind: str):
    """What a broken peer sends instead of `value` (a tensor, a loss, or None)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return float("nan") if kind == "nan" else value
    if kind == "nan":
        return torch.full_like(value, float("nan"))
    return value[..., :-1].contiguous()  # one value short in the last dimension


class InjectedFault(RuntimeError):
    """A failure injected on purpose (`--fault-fail-rate`)."""


@dataclass(frozen=True)
class FaultSettings:
    slowdown: float = 1.0  # every compute takes this many times as long (extra time is slept)
    fail_rate: float = 0.0  # fraction of calls that fail with an internal error
    garbage: str = "none"  # what a garbage answer holds: none, nan or shape (one value short)
    garbage_rate: float = 1.0  # fraction of calls answered with garbage (with garbage != none)
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.slowdown != 1.0 or self.fail_rate > 0.0 or self.garbage != "none"

    def __post_init__(self) -> None:
        if self.slowdown < 1.0 or not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("--fault-slowdown must be >= 1 and --fault-fail-rate within [0, 1]")
        if self.garbage not in GARBAGE_KINDS or not 0.0 <= self.garbage_rate <= 1.0:
            raise ValueError(f"--fault-garbage must be one of {', '.join(GARBAGE_KINDS)} and "
                             f"--fault-garbage-rate within [0, 1]")


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

    def _garbage_now(self) -> bool:
        return self._settings.garbage != "none" and self._rng.random() < self._settings.garbage_rate

    def forward(self, microbatch_id: str, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        outputs = self._run(self._runtime.forward, microbatch_id, inputs, targets)
        return garbled(outputs, self._settings.garbage) if self._garbage_now() else outputs

    def backward(self, microbatch_id: str, inputs: torch.Tensor, **kwargs):
        grad_inputs, loss = self._run(self._runtime.backward, microbatch_id, inputs, **kwargs)
        if self._garbage_now():
            return garbled(grad_inputs, self._settings.garbage), garbled(loss, self._settings.garbage)
        return grad_inputs, loss
