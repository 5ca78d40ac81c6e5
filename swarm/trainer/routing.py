"""Replica choice for one pipeline stage: SWARM's interleaved weighted round-robin.

Every replica of the stage has a key: the busy time the trainer expects to have queued on it.
``choose`` gives a task to the replica with the smallest key and adds the task's expected duration,
``samples * cost(task) * seconds_per_sample``; so each replica receives work in proportion to its
throughput, interleaved. Keys are measured from the latest pick's (held at 0), so a replica that
sat out picks banks no credit, and a new replica enters at the minimum key.

Throughput is an EMA (``ema_alpha``) of measured seconds per forward-equivalent sample; a backward
costs ``backward_cost`` samples, one fewer on the replica that holds its forward's activations.
The throughput a peer announced is only a prior, believed up to the fastest measured replica of
the stage (or `PRIOR_SPREAD` times the slowest announcement); the first measurement replaces it,
and the n-th weighs ``max(ema_alpha, 1/n)``.

Pure: no I/O, no asyncio, time only from the injected clock.
Why each rule: docs/design/trainer.md.
"""

from __future__ import annotations

import math
import numbers
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

Task = Literal["forward", "backward", "backward_cached"]
"""backward_cached: a backward answered from the activations the replica cached in its forward
(reported as such, so that its shorter time is not read as a faster replica)."""

# Bounds on seconds per sample keep every key finite whatever the DHT or a clock reports.
_MIN_SECONDS_PER_SAMPLE = 1e-9
_MAX_SECONDS_PER_SAMPLE = 1e9
# Tasks chosen but never reported (cancelled by the caller) must not accumulate forever.
_MAX_PENDING_PER_REPLICA = 1024
# An unmeasured replica is believed at most this many times as fast as the slowest announcement of
# its stage (honest start-up benchmarks differ by up to about 2x), when no replica is measured yet.
PRIOR_SPREAD = 2.0


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica of a stage, as read from the DHT.

    peer_id: the peer serving the stage.
    announced_throughput: forward samples per second the peer announced. 0, negative, NaN, inf
        or None mean "unknown"; the scheduler then starts from its ``default_throughput``.
    """

    peer_id: str
    announced_throughput: float


@dataclass
class _PendingTask:
    """A task handed to a replica and not yet reported back."""

    task: Task
    samples: int
    charge_s: float
    started_at_s: float


@dataclass
class _ReplicaState:
    key_s: float
    seconds_per_sample: float
    measurements: int = 0
    pending: deque[_PendingTask] = field(default_factory=lambda: deque(maxlen=_MAX_PENDING_PER_REPLICA))


class ReplicaScheduler:
    """Interleaved weighted round-robin over the replicas of ONE stage.

    ema_alpha: weight of each new measurement in the throughput EMA, in (0, 1].
    backward_cost: duration of a backward pass relative to a forward pass of the same samples
        (the replica recomputes the forward, then backpropagates).
    default_throughput: forward samples per second assumed for a replica that announced none.
    prior_spread: how many times the slowest announcement an unmeasured replica is believed, at
        most, while no replica of the stage is measured (inf: announcements are believed).
    clock: seconds, monotonic; used to settle the busy time of failed tasks.
    """

    def __init__(
        self,
        *,
        ema_alpha: float = 0.1,
        backward_cost: float = 2.5,
        default_throughput: float = 1.0,
        prior_spread: float = PRIOR_SPREAD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha}")
        if not (math.isfinite(backward_cost) and backward_cost > 0.0):
            raise ValueError(f"backward_cost must be a positive number, got {backward_cost}")
        if not (math.isfinite(default_throughput) and default_throughput > 0.0):
            raise ValueError(f"default_throughput must be positive samples/s, got {default_throughput}")
        self._ema_alpha = ema_alpha
        # A backward recomputes the forward (1) unless the replica cached it: then it costs one less.
        self._task_costs: dict[str, float] = {
            "forward": 1.0,
            "backward": backward_cost,
            "backward_cached": max(backward_cost - 1.0, 0.5 * backward_cost),
        }
        if not prior_spread >= 1.0:
            raise ValueError(f"prior_spread must be at least 1, got {prior_spread}")
        self._default_throughput = default_throughput
        self._prior_spread = prior_spread
        self._clock = clock
        self._replicas: dict[str, _ReplicaState] = {}

    def update_replicas(self, replicas: Sequence[ReplicaInfo]) -> None:
        """Replace the replica set with the one just read from the DHT.

        Peers no longer listed are dropped with their history. New peers enter at the current
        minimum key, so they get work soon but are not flooded. A known peer's announced
        throughput is used only until the trainer has measured the peer itself, and believed up to
        the ceiling in the module's docstring. If a peer is listed twice, the last entry wins.
        """
        latest = {info.peer_id: info for info in replicas}
        for peer_id in [p for p in self._replicas if p not in latest]:
            del self._replicas[peer_id]
        entry_key_s = min((r.key_s for r in self._replicas.values()), default=0.0)
        priors = {p: self._seconds_per_sample_from(info.announced_throughput) for p, info in latest.items()}
        measured = [r.seconds_per_sample for r in self._replicas.values() if r.measurements]
        # the ceiling on belief (in seconds per sample, a floor): see the module's docstring
        fastest_believed = min(measured) if measured else max(priors.values(), default=0.0) / self._prior_spread
        for peer_id in sorted(latest):
            seconds_per_sample = max(priors[peer_id], fastest_believed)
            replica = self._replicas.get(peer_id)
            if replica is None:
                self._replicas[peer_id] = _ReplicaState(entry_key_s, seconds_per_sample)
            elif replica.measurements == 0:
                replica.seconds_per_sample = seconds_per_sample

    def choose(
        self, task: Task, samples: int, exclude: Collection[str] = (), *, cached_on: str | None = None
    ) -> str | None:
        """Pick the replica with the least expected busy time and charge it this task.

        exclude: peers not to use (banned, or already failed for this microbatch).
        cached_on (backward only): the replica that served this microbatch's forward and holds its
            activations, so its backward skips the recomputed forward (``backward_cost - 1``
            forward samples instead of ``backward_cost``). It is chosen when it is expected to
            finish the backward no later than the least busy replica would, recompute included.
        Returns the chosen peer_id, or None when every replica is excluded or none is known.
        Ties go to the smallest peer_id, so the same calls always give the same choices.
        """
        cost = self._task_cost(task)
        _check_samples(samples)
        excluded = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        candidates = [(r.key_s, p) for p, r in self._replicas.items() if p not in excluded]
        if not candidates:
            return None
        key_s, peer_id = min(candidates)
        self._move_frontier_to(key_s)
        if (
            task == "backward"
            and cached_on is not None
            and cached_on != peer_id
            and cached_on in self._replicas
            and cached_on not in excluded
        ):
            holder = self._replicas[cached_on]
            finish_there_s = holder.key_s + samples * self._task_costs["backward_cached"] * holder.seconds_per_sample
            finish_least_busy_s = samples * cost * self._replicas[peer_id].seconds_per_sample  # its key is now 0
            if finish_there_s <= finish_least_busy_s:
                peer_id = cached_on
        if task == "backward" and peer_id == cached_on:
            task = "backward_cached"
        self.charge(peer_id, task, samples)
        return peer_id

    def charge(self, peer_id: str, task: Task, samples: int) -> bool:
        """Charge `peer_id` this task without choosing: a call made again to the same replica (a
        backward whose answer was lost) is charged like any call, so its report settles its own
        charge and not another pending task of the peer. False, charging nobody, when the peer is
        no longer known."""
        cost = self._task_cost(task)
        _check_samples(samples)
        replica = self._replicas.get(peer_id)
        if replica is None:
            return False
        charge_s = samples * cost * replica.seconds_per_sample
        replica.key_s += charge_s
        replica.pending.append(_PendingTask(task, samples, charge_s, self._clock()))
        return True

    def report_success(self, peer_id: str, task: Task, samples: int, elapsed_s: float) -> None:
        """Fold a measured call into the peer's throughput EMA.

        elapsed_s: seconds the call kept the replica busy, as the caller measured it: the pipeline
        passes its own service time (swarm/trainer/service_clock.py), never times the replica
        reports about itself, which it could set to ~0 to draw every call; 0 (below clock
        resolution) carries no information and only settles the task. Reports for peers dropped
        since are ignored.
        """
        cost = self._task_cost(task)
        _check_samples(samples)
        if not (math.isfinite(elapsed_s) and elapsed_s >= 0.0):
            raise ValueError(f"elapsed_s must be a finite number >= 0, got {elapsed_s}")
        replica = self._replicas.get(peer_id)
        if replica is None:
            return
        _pop_pending(replica, task, samples)
        if elapsed_s == 0.0:
            return
        measured = _clamp_seconds_per_sample(elapsed_s / (samples * cost))
        replica.measurements += 1
        alpha = max(self._ema_alpha, 1.0 / replica.measurements)  # the first one replaces the prior
        replica.seconds_per_sample = alpha * measured + (1.0 - alpha) * replica.seconds_per_sample

    def report_failure(self, peer_id: str) -> None:
        """Settle the busy time of the peer's oldest unreported task after it failed.

        The peer keeps the time it was actually tied up (up to the task's expected duration):
        a call that timed out keeps its whole charge, a call refused at once gives it back, so
        the retry charged to another replica is not counted twice. Throughput is not changed:
        a failure is not a speed measurement (bans and timeouts deal with failing peers).
        """
        replica = self._replicas.get(peer_id)
        if replica is None or not replica.pending:
            return
        pending = replica.pending.popleft()
        busy_s = max(self._clock() - pending.started_at_s, 0.0)
        refund_s = max(pending.charge_s - busy_s, 0.0)
        replica.key_s = max(replica.key_s - refund_s, 0.0)

    def expected_s(self, peer_id: str, task: Task, samples: int) -> float | None:
        """How long `task` of `samples` is expected to keep `peer_id` busy, at its believed
        throughput (None for a peer not known): what a first call's timeout is sized on."""
        replica = self._replicas.get(peer_id)
        if replica is None:
            return None
        return samples * self._task_cost(task) * replica.seconds_per_sample

    def measured(self, peer_id: str) -> bool:
        """Whether `peer_id`'s throughput is measured (False: the announced prior, or not known)."""
        replica = self._replicas.get(peer_id)
        return replica is not None and replica.measurements > 0

    def throughputs(self) -> dict[str, float]:
        """Current estimate per replica, in forward samples per second, by peer_id."""
        return {p: 1.0 / self._replicas[p].seconds_per_sample for p in sorted(self._replicas)}

    def shares(self) -> dict[str, float]:
        """Fraction of the stage's samples each replica should receive (sums to 1)."""
        throughputs = self.throughputs()
        total = sum(throughputs.values())
        return {p: t / total for p, t in throughputs.items()}

    def keys_s(self) -> dict[str, float]:
        """Expected busy time per replica, in seconds ahead of the latest pick."""
        return {p: self._replicas[p].key_s for p in sorted(self._replicas)}

    def _task_cost(self, task: str) -> float:
        try:
            return self._task_costs[task]
        except KeyError:
            raise ValueError(f"task must be 'forward', 'backward' or 'backward_cached', got {task!r}") from None

    def _seconds_per_sample_from(self, announced_throughput: float | None) -> float:
        throughput = announced_throughput
        if throughput is None or not math.isfinite(throughput) or throughput <= 0.0:
            throughput = self._default_throughput
        return _clamp_seconds_per_sample(1.0 / throughput)

    def _move_frontier_to(self, key_s: float) -> None:
        for replica in self._replicas.values():
            replica.key_s = max(replica.key_s - key_s, 0.0)


def _check_samples(samples: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples <= 0:
        raise ValueError(f"samples must be a positive int, got {samples!r}")


def _clamp_seconds_per_sample(seconds_per_sample: float) -> float:
    return min(max(seconds_per_sample, _MIN_SECONDS_PER_SAMPLE), _MAX_SECONDS_PER_SAMPLE)


def _pop_pending(replica: _ReplicaState, task: Task, samples: int) -> None:
    """Settle the oldest pending task that matches, else the oldest one."""
    for index, pending in enumerate(replica.pending):
        if pending.task == task and pending.samples == samples:
            del replica.pending[index]
            return
    if replica.pending:
        replica.pending.popleft()
