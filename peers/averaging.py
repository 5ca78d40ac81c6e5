"""Keeping the replicas of one stage in agreement, on hivemind's DecentralizedAverager.

Two modes (`--averaging`):
* `sync`: replicas do not step on their own. When the trainer has finished a step it sends every
  replica a commit; the replicas all-reduce their mean gradients weighted by the samples each saw
  (so the result is the mean gradient over every sample of the step, as in one process) and then
  all step with it: their parameters stay identical.
* `periodic`: each replica steps on its own gradients; every `averaging_period_s` seconds
  (aligned to DHT time, so replicas meet without coordination) they average their parameters.
  Optimizer state is not averaged.

Compression (`--averaging-compression`, default none): hivemind's all-reduce sends each replica
the difference between the average and its own tensor, compressed. With fp16 the traffic halves,
but each replica adds its own rounded difference, so replicas then agree only to fp16 precision of
those differences (measured: up to 1.5e-5 apart after one sync step of the tiny model at lr 0.5),
which breaks the "identical parameters" promise; hence uncompressed by default.

Every method here runs on the peer's compute thread, so no forward or backward ever sees
tensors halfway through an averaging round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import hivemind
import torch
from hivemind.compression import Float16Compression, NoCompression
from hivemind.utils import get_dht_time

from peers.stage_runtime import StageRuntime

logger = logging.getLogger(__name__)

AVERAGING_MODES = ("none", "sync", "periodic")


@dataclass(frozen=True)
class AveragingOutcome:
    averaged: bool  # whether an all-reduce with other replicas took place
    group_size: int  # replicas in the round (1 = alone)
    samples: int  # samples behind the applied update (sync mode)
    stepped: bool


def averager_prefix(model: str, stage: int, num_stages: int, kind: str) -> str:
    return f"swarm_{model}_stage{stage}of{num_stages}_{kind}".replace(".", "_")


COMPRESSIONS = {"none": NoCompression, "fp16": Float16Compression}


class _Averager:
    def __init__(self, dht: hivemind.DHT, tensors: list[torch.Tensor], prefix: str, *, timeout_s: float,
                 matchmaking_s: float, compression: str):
        self.timeout_s = timeout_s
        self.bytes_per_value = 2 if compression == "fp16" else 4
        self.averager = hivemind.averaging.DecentralizedAverager(
            tensors, dht, start=True, prefix=prefix, min_matchmaking_time=matchmaking_s,
            request_timeout=min(matchmaking_s / 2, 1.0), compression=COMPRESSIONS[compression](), min_group_size=2)
        self.bytes_averaged = 0
        self.rounds = 0

    def run(self, group_size: int, weight: float, scheduled_time: float | None = None) -> dict | None:
        """One all-reduce round; the gathered data of the group, or None if no group formed."""
        self.averager.target_group_size = group_size
        try:
            gathered = self.averager.step(weight=weight, gather=weight, timeout=self.timeout_s,
                                          scheduled_time=scheduled_time, allow_retries=False)
        except Exception as e:  # a failed round must not take the peer down; replicas re-converge later
            logger.warning(f"Averaging round failed: {type(e).__name__}: {e}")
            return None
        if gathered is not None:
            self.rounds += 1
            # each replica sends its tensors once and receives the averaged parts once
            self.bytes_averaged += 2 * self.bytes_per_value * sum(t.numel() for t in self.averager._averaged_tensors)
        return gathered

    def shutdown(self) -> None:
        self.averager.shutdown()


class GradientSync:
    """`sync` mode: all replicas apply the same sample-weighted mean gradient on every commit."""

    def __init__(self, runtime: StageRuntime, dht: hivemind.DHT, model: str, *, timeout_s: float = 30.0,
                 matchmaking_s: float = 0.5, compression: str = "none"):
        self.runtime = runtime
        runtime.auto_step = False
        self.buffers = [torch.zeros_like(p) for p in runtime.params]
        self._averager = _Averager(dht, self.buffers, averager_prefix(model, runtime.stage, runtime.num_stages, "grad"),
                                   timeout_s=timeout_s, matchmaking_s=matchmaking_s, compression=compression)
        self.committed: set[str] = set()

    def commit(self, step_id: str, group_size: int) -> AveragingOutcome:
        """Average with the other replicas (when there are any) and step. A repeated commit of the
        same step (a trainer retry) is answered without stepping twice."""
        if step_id in self.committed:
            return AveragingOutcome(False, 1, 0, stepped=False)
        self.committed.add(step_id)
        local_samples = self.runtime.samples_accumulated
        with self._averager.averager.get_tensors() as buffers:
            for buffer, mean in zip(buffers, self.runtime.local_mean_gradients()):
                buffer.copy_(mean)
        gathered = None
        if group_size > 1:
            # weight 0 would make an all-zero group divide by zero; a tiny weight changes nothing
            gathered = self._averager.run(group_size, weight=max(float(local_samples), 1e-9))
            if gathered is None:
                logger.warning(f"stage {self.runtime.stage}: no averaging group formed; stepping on local gradients")
        total = sum(int(round(w)) for w in gathered.values()) if gathered else local_samples
        if total == 0:
            return AveragingOutcome(gathered is not None, len(gathered or {0: 0}), 0, stepped=False)
        with self._averager.averager.get_tensors() as buffers:
            mean_gradients = [buffer.clone() for buffer in buffers]
        self.runtime.apply_gradients(mean_gradients)
        return AveragingOutcome(gathered is not None, len(gathered) if gathered else 1, total, stepped=True)

    @property
    def rounds(self) -> int:
        return self._averager.rounds

    @property
    def bytes_averaged(self) -> int:
        return self._averager.bytes_averaged

    def shutdown(self) -> None:
        self._averager.shutdown()


class ParameterAveraging:
    """`periodic` mode: replicas step on their own and average parameters every period."""

    def __init__(self, runtime: StageRuntime, dht: hivemind.DHT, model: str, *, period_s: float,
                 timeout_s: float = 30.0, matchmaking_s: float = 1.0, compression: str = "none"):
        self.runtime, self.period_s = runtime, period_s
        # .data: the same memory as the parameters, without autograd (the averager writes in place)
        self._averager = _Averager(dht, [p.data for p in runtime.params], averager_prefix(model, runtime.stage, runtime.num_stages,
                                                                             "params"),
                                   timeout_s=timeout_s, matchmaking_s=matchmaking_s, compression=compression)

    def next_round_time(self) -> float:
        """The next multiple of the period in DHT time: every replica picks the same moment."""
        now = get_dht_time()
        return (int(now // self.period_s) + 1) * self.period_s

    def average(self, group_size: int, scheduled_time: float) -> AveragingOutcome:
        if group_size < 2:
            return AveragingOutcome(False, 1, 0, stepped=False)
        gathered = self._averager.run(group_size, weight=1.0, scheduled_time=scheduled_time)
        return AveragingOutcome(gathered is not None, len(gathered) if gathered else 1, 0, stepped=False)

    @property
    def rounds(self) -> int:
        return self._averager.rounds

    @property
    def bytes_averaged(self) -> int:
        return self._averager.bytes_averaged

    def shutdown(self) -> None:
        self._averager.shutdown()
