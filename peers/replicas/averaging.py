"""Keeping the replicas of one stage in agreement, on hivemind's DecentralizedAverager.

Two modes (`--averaging`):
* `sync` (`GradientSync`): on the trainer's commit the replicas all-reduce their gradients weighted
  by the samples each saw, then all step: their parameters stay identical, the update one process
  would make. A failed round steps no replica and the gradients carry over; a round that failed on
  one side only is repaired by the trainer (`CommitRequest.catch_up_from`, peers/replicas/replica_sync.py).
* `periodic`: each replica steps on its own gradients and they average parameters every
  `averaging_period_s` seconds or after every `averaging_every_steps` local steps
  (peers/replicas/averaging_schedule.py); `--outer-lr` adds an outer step (peers/replicas/outer_step.py).

`--averaging-compression` shrinks the traffic (the replicas then agree up to the codec's rounding);
`--robust-averaging` bounds a liar (peers/replicas/robust_mean.py). Each round's traffic is counted
(`AveragingRound`). hivemind all-reduces CPU tensors: each mode hands it one flat CPU buffer, on
any device. Every method runs on the peer's compute thread, so no forward or backward sees tensors
halfway through a round.

The reasoning and the measurements: docs/design/replicas.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, replace

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
)
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from peers.compute.stage_runtime import StageRuntime
from peers.replicas.averaging_members import MIN_WEIGHT, MemberAverager, capped_weight, named_group_id
from peers.replicas.averaging_schedule import AveragingSchedule
from peers.replicas.gloo_allreduce import GlooRounds
from peers.replicas.outer_step import OuterOptimizer, OuterSettings
from peers.replicas.robust_mean import ROBUST_METHODS
from peers.replicas.sync_exchange import SyncExchange

logger = logging.getLogger(__name__)

AVERAGING_MODES = ("none", "sync", "periodic", "outer")
REMEMBERED_OUTCOMES = 64  # commits whose answers a replica keeps for repeats
# step ids a replica remembers as committed: a trainer repeats an unanswered commit within seconds;
# unbounded, 100,000 commits of made-up step ids grew the set by 17 MiB (issue #60)
REMEMBERED_COMMITS = 4096
COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "int8": BlockwiseQuantization,
}


class RecentIds:
    """The latest `max_size` ids added, as a set (`in`, `add`): the oldest is forgotten first."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, item: str) -> None:
        self._ids[item] = None
        self._ids.move_to_end(item)
        while len(self._ids) > self.max_size:
            self._ids.popitem(last=False)


class AveragingClosed(RuntimeError):
    """A round asked of an averager that is shutting down."""


class AveragerDidNotStart(RuntimeError):
    """hivemind's averager process did not become ready (its DHT process gone, most often)."""


AVERAGER_START_TIMEOUT_S = 60.0  # for hivemind's averager process to become ready (about a second)


@dataclass(frozen=True)
class AveragingOutcome:
    averaged: bool  # whether an all-reduce with other replicas took place
    group_size: int  # replicas in the round (1 = alone)
    samples: int  # samples behind the applied update (sync mode) or the local step (periodic by steps)
    stepped: bool  # sync and periodic by steps: the replica took an optimizer step on this commit
    outer_stepped: bool = False  # periodic: an outer (DiLoCo) step followed the round
    pending: bool = False  # sync with a one-step delay: this commit's round is in flight (applied at the next)
    grad_norm_sq: float | None = None  # clipping's "prepare": the held mean gradient's squared norm


@dataclass(frozen=True)
class AveragingRound:
    """One attempted all-reduce with the stage's other replicas, as the metrics see it."""

    mode: str  # "sync" or "periodic"
    ok: bool  # False: no group formed in time, or the all-reduce failed
    group_size: int  # replicas in the round (0 when it failed)
    sent_bytes: int
    received_bytes: int


def averager_prefix(model: str, stage: int, num_stages: int, kind: str) -> str:
    return f"swarm_{model}_stage{stage}of{num_stages}_{kind}".replace(".", "_")


def allreduce_bytes_each_way(num_values: int, group_size: int, wire_bytes_per_value: float) -> int:
    """Bytes one replica sends (and as many it receives) in a butterfly all-reduce of `num_values`
    values over `group_size` replicas with equal parts: its n-1 foreign parts go out and come back
    averaged, and the n-1 groupmates' copies of its own part come in and go back as differences."""
    if group_size < 2:
        return 0
    return round(2 * (group_size - 1) / group_size * num_values * wire_bytes_per_value)


def wire_bytes_per_value(compression: CompressionBase, tensors: Sequence[torch.Tensor]) -> float:
    """The codec's serialized size per value, measured on these tensors."""
    total = sum(len(compression.compress(t, CompressionInfo.from_tensor(t)).SerializeToString()) for t in tensors)
    return total / max(sum(t.numel() for t in tensors), 1)


def cancel_round(control: StepControl) -> None:
    """Cancel a round unless it is over; hivemind's `StepControl.cancel` fails when called twice (a
    round the peer's shutdown cancelled, then the thread that waited on it)."""
    if control.done():
        return
    try:
        control.cancel()
    except InvalidStateError:  # cancelled by another thread in between
        pass


class ReplicaAveraging:
    """What both modes share: a DecentralizedAverager over some tensors, rounds of all-reduce with
    a timeout, and the count of rounds, failures and bytes (reported through `on_round`)."""

    mode = ""
    reason = ""  # why this mode (`--averaging auto`), as the peer's record states it
    closing = False  # set by `close`: no round begins, and rounds cut short are not failures to warn of

    def __init__(
        self,
        dht: hivemind.DHT,
        like: Sequence[torch.Tensor],
        prefix: str,
        *,
        timeout_s: float,
        matchmaking_s: float,
        compression: str,
        on_round: Callable[[AveragingRound], None] | None = None,
        members: Collection[str] | None = None,
        robust: str = "clip",
    ):
        """`like`: the tensors whose values are averaged (a stage's parameters); the averager holds
        one flat CPU buffer of them, whatever their device (`buffers`: a view shaped as each). hivemind
        sends every tensor it averages as parts of its own, so a tensor per parameter cost a message
        (and its framing, executor hops and reduction) for every bias and norm; one flat buffer goes
        in parts of hivemind's part size, and the robust reduction still goes tensor by tensor.
        `members`: the peers allowed in a round (peers/replicas/averaging_members.py), kept fresh
        with `set_members`; None: anyone (no run authority). `robust`: how the part this replica
        reduces is averaged over its senders (peers/replicas/robust_mean.py)."""
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown averaging compression {compression!r}; use one of {', '.join(COMPRESSIONS)}")
        if robust not in ROBUST_METHODS:
            raise ValueError(f"unknown robust averaging {robust!r}; use one of {', '.join(ROBUST_METHODS)}")
        self.timeout_s, self.compression, self.on_round = timeout_s, compression, on_round
        # step ids already committed (a trainer retries unanswered commits), the latest REMEMBERED_COMMITS
        self.committed = RecentIds(REMEMBERED_COMMITS)
        # the answers of the latest commits: a repeated commit (a retry, or another trainer committing
        # the run's global step) gets the first one's, so every trainer sees the same outcome
        self.outcomes: OrderedDict[str, AveragingOutcome] = OrderedDict()
        codec = COMPRESSIONS[compression]()
        flat = torch.zeros(sum(t.numel() for t in like), dtype=common_dtype(like))
        self.num_values = flat.numel()
        self.wire_bytes_per_value = wire_bytes_per_value(codec, [flat])
        if not dht.is_alive():  # hivemind's averager would wait for its answers forever
            raise AveragerDidNotStart(f"the averager of {prefix!r} cannot start: the DHT process is not running")
        self.averager = MemberAverager(
            [flat],
            dht,
            members=members,
            robust=robust,
            tensor_sizes=[t.numel() for t in like],
            start=False,
            prefix=prefix,
            min_matchmaking_time=matchmaking_s,
            request_timeout=min(matchmaking_s / 2, 1.0),
            compression=codec,
            min_group_size=2,
            allreduce_timeout=timeout_s,
        )
        self.members_only = members is not None
        try:
            if threading.current_thread() is threading.main_thread():
                self.averager.run_in_background(await_ready=True, timeout=AVERAGER_START_TIMEOUT_S)
            else:
                # hivemind's run_in_background sets a SIGINT handler, which only the main thread may do: a
                # peer that moves builds its next stage (and this averager) on a worker thread.
                self.averager.start()
                self.averager.wait_until_ready(timeout=AVERAGER_START_TIMEOUT_S)
        except TimeoutError:  # without a timeout this waited forever (seen when the DHT process had died)
            if self.averager.is_alive():
                self.averager.terminate()
            state = "running" if dht.is_alive() else "not running"
            raise AveragerDidNotStart(
                f"the averager of {prefix!r} did not start within {AVERAGER_START_TIMEOUT_S:.0f} s "
                f"(the DHT process is {state})"
            ) from None
        with self.averager.get_tensors() as (flat,):  # after hivemind moved it to shared memory
            self.flat, self.buffers = flat, shaped_like(flat, like)
        self.tensor_sizes = [t.numel() for t in like]
        self.robust = robust
        self.rounds = self.failed_rounds = 0
        self.bytes_sent = self.bytes_received = 0
        # rounds begun and not yet finished: `shutdown` cancels them, so that a thread waiting in
        # one (the compute thread, a commit's RPC handler) returns at once instead of at its timeout
        self.open_rounds: set[StepControl] = set()

    @contextlib.contextmanager
    def held_buffers(self) -> Iterator[list[torch.Tensor]]:
        """Each averaged tensor's slice of the averager's buffer, while no all-reduce can touch it."""
        with self.averager.get_tensors():
            yield self.buffers

    @property
    def bytes_averaged(self) -> int:
        return self.bytes_sent + self.bytes_received

    def begin_round(
        self,
        group_size: int,
        weight: float,
        scheduled_time: float | None = None,
        *,
        wait_for_trigger: bool = False,
        named: tuple[bytes, Mapping[str, float]] | None = None,
    ) -> StepControl:
        """Start looking for a group of `group_size` replicas in the background (the averager's own
        process). With `wait_for_trigger`, the all-reduce then waits for `finish_round`. `named`: the
        group a commit named (its id, and the weight of each member), which skips matchmaking."""
        if self.closing:
            raise AveragingClosed("the peer is stopping")
        self.averager.name_next_group(*(named or (None,)))
        self.averager.expect_group(group_size)  # robust averaging: no pair where three or more are live
        self.averager.target_group_size = group_size
        control = self.averager.step(
            weight=weight,
            gather=weight,
            timeout=self.timeout_s,
            scheduled_time=scheduled_time,
            allow_retries=False,
            require_trigger=wait_for_trigger,
            wait=False,
        )
        self.open_rounds.add(control)
        return control

    def try_begin_round(self, group_size: int, weight: float, **kwargs) -> StepControl | None:
        """`begin_round`, or None (a failed round, counted) if it cannot start; the peer goes on."""
        try:
            return self.begin_round(group_size, weight, **kwargs)
        except Exception as e:  # noqa: BLE001 - a round that cannot start is a failed round
            if not self.closing:
                logger.warning(f"Averaging round could not start: {type(e).__name__}: {e}")
            self.record_failure()
            return None

    def finish_round(self, control: StepControl) -> dict | None:
        """Let the all-reduce run, wait for it and count it: the gathered data of the group, or
        None if the round failed. Writes the averaged tensors, so call it on the compute thread."""
        try:
            if not control.triggered:
                control.allow_allreduce()
            # hivemind bounds matchmaking and the all-reduce by timeout_s each; this is a safety net
            gathered = control.result(timeout=2 * self.timeout_s + 5.0)
            if gathered is None:
                logger.warning("Averaging round failed: no group formed")
        except Exception as e:  # a failed round must not take the peer down; replicas re-converge later
            if self.closing:
                logger.info("Averaging round cancelled: the peer is stopping")
            else:
                logger.warning(f"Averaging round failed: {type(e).__name__}: {e}")
            cancel_round(control)
            gathered = None
        finally:
            self.open_rounds.discard(control)
        if gathered is None:
            self.record_failure()
            return None
        self.record_success(len(gathered))
        return gathered

    def record_success(self, group_size: int, each_way: int | None = None) -> None:
        """A round that succeeded; `each_way`: the bytes it sent (and received), when it is not
        hivemind's butterfly all-reduce of this replica's buffer."""
        if each_way is None:
            each_way = allreduce_bytes_each_way(self.num_values, group_size, self.wire_bytes_per_value)
        self.rounds += 1
        self.bytes_sent += each_way
        self.bytes_received += each_way
        self._report(
            AveragingRound(self.mode, ok=True, group_size=group_size, sent_bytes=each_way, received_bytes=each_way)
        )

    def _remember(self, step_id: str, outcome: AveragingOutcome) -> AveragingOutcome:
        self.outcomes[step_id] = outcome
        while len(self.outcomes) > REMEMBERED_OUTCOMES:
            self.outcomes.popitem(last=False)
        return outcome

    def _repeated(self, step_id: str) -> AveragingOutcome:
        """The answer to a repeated commit: the first one's outcome, as far as it is remembered."""
        return self.outcomes.get(step_id, AveragingOutcome(False, 1, 0, stepped=False))

    def _first_commit_of(self, step_id: str) -> bool:
        """Whether this is the first commit of `step_id`; a repeated one must not step twice."""
        if step_id in self.committed:
            return False
        self.committed.add(step_id)
        return True

    def record_failure(self) -> None:
        self.failed_rounds += 1
        self._report(AveragingRound(self.mode, ok=False, group_size=0, sent_bytes=0, received_bytes=0))

    def _all_reduce(self, group_size: int, weight: float, named=None) -> dict | None:
        """One round, from matchmaking (unless `named`) to the averaged tensors, on the calling thread."""
        control = self.try_begin_round(group_size, weight, named=named)
        return None if control is None else self.finish_round(control)

    def set_members(self, members: Collection[str]) -> None:
        if self.members_only:
            self.averager.set_members(members)

    def _report(self, averaging_round: AveragingRound) -> None:
        if self.on_round is not None:
            self.on_round(averaging_round)

    def close(self) -> None:
        """The peer is stopping: begin no more rounds and cancel those still open, so that a thread
        waiting in one (the compute thread, a commit's handler) returns at once, its round failed,
        instead of at the round's timeout. Any thread may call it, more than once."""
        self.closing = True
        for control in list(self.open_rounds):
            cancel_round(control)
        self.open_rounds.clear()

    def shutdown(self) -> None:
        self.close()
        self.averager.shutdown()


class GradientSync(ReplicaAveraging):
    """`sync` mode: all replicas apply the same sample-weighted mean gradient on every commit."""

    mode = "sync"
    gloo: GlooRounds | None = None  # exact sync over gloo (`__init__`)
    exchange: SyncExchange | None = None  # exact sync by exchange (`__init__`)
    rendezvous: str | None = None  # the gloo leader the commit being handled names
    exchanged: bool = False  # whether the commit being handled asks for a round by exchange

    def __init__(
        self,
        runtime: StageRuntime,
        dht: hivemind.DHT,
        model: str,
        *,
        timeout_s: float = 30.0,
        matchmaking_s: float = 0.5,
        compression: str = "none",
        on_round: Callable[[AveragingRound], None] | None = None,
        members: Collection[str] | None = None,
        robust: str = "clip",
        named_groups: bool = False,
        gloo: GlooRounds | None = None,
        exchange: SyncExchange | None = None,
    ):
        """`named_groups`: a commit that names its group (the replicas and what each served) skips
        hivemind's matchmaking (peers/replicas/averaging_members.py); False: matchmaking always.
        `gloo`: this peer's gloo rounds; a commit that names its group and a rendezvous then
        all-reduces over gloo instead of hivemind (peers/replicas/gloo_allreduce.py). `exchange`:
        this peer's exchange; a commit that names its group and asks for it (`CommitRequest.sync_exchange`)
        then fetches the members' gradients instead (peers/replicas/sync_exchange.py)."""
        self.runtime = runtime
        self.named_groups = named_groups
        self.gloo, self.exchange = gloo, exchange
        runtime.auto_step = False
        self.prepared: AveragingOutcome | None = None  # clipping: the outcome of a prepared, unapplied step
        super().__init__(  # the buffers: the stage's gradients, averaged
            dht,
            runtime.params,
            averager_prefix(model, runtime.stage, runtime.num_stages, "grad"),
            timeout_s=timeout_s,
            matchmaking_s=matchmaking_s,
            compression=compression,
            on_round=on_round,
            members=members,
            robust=robust,
        )

    def commit(self, step_id: str, group_size: int, samples: Mapping[str, int] | None = None) -> AveragingOutcome:
        """Average with the other replicas (when there are any) and step. A repeated commit of the
        same step (a trainer retry) is answered without stepping twice. `samples`: what the trainer
        saw each replica serve in the step; no replica weighs more than its count in the round."""
        if not self._first_commit_of(step_id):
            return self._repeated(step_id)
        return self._remember(step_id, self.average_and_step(group_size, samples, step_id))

    def average_and_step(
        self, group_size: int, samples: Mapping[str, int] | None, step_id: str | None = None
    ) -> AveragingOutcome:
        """The exact barrier: all-reduce what this replica accumulated with the group, then step."""
        outcome = self.average_gradients(group_size, samples, step_id)
        if outcome.stepped:
            self.runtime.apply_gradients(self.averaged_gradients())
        return outcome

    def named_group(self, step_id: str | None, caps: Mapping[str, int] | None) -> tuple[bytes, dict] | None:
        """The group a commit names: the replicas its `samples` list (this one among them), each
        weighing what it served; None (matchmaking) without them, or with `named_groups` off."""
        if not self.named_groups or step_id is None or not caps:
            return None
        if self.averager.peer_id.to_base58() not in caps:
            return None
        return named_group_id(step_id, caps), {p: max(float(n), MIN_WEIGHT) for p, n in caps.items()}

    def average_gradients(
        self, group_size: int, samples: Mapping[str, int] | None, step_id: str | None = None
    ) -> AveragingOutcome:
        """All-reduce what this replica accumulated with the group; the averager's buffers then hold
        the mean gradient. The outcome's `stepped` says whether to step on it (the caller steps).
        `step_id`: the commit's, which with `samples` names the group (no matchmaking)."""
        local_samples = self.runtime.samples_accumulated
        caps = dict(samples) if samples else None
        with self.held_buffers() as buffers:
            for buffer, mean in zip(buffers, self.runtime.local_mean_gradients()):
                buffer.copy_(mean)
        gathered = None
        if group_size > 1:
            self.averager.set_weight_caps(caps)
            rendezvous, self.rendezvous = self.rendezvous, None
            exchanged, self.exchanged = self.exchanged, False
            named = step_id is not None and self.named_group(step_id, caps) is not None
            if named and self.gloo is not None and rendezvous:
                gathered = self._named_round(self.gloo, rendezvous, step_id, caps)
            elif named and self.exchange is not None and exchanged:
                gathered = self._named_round(self.exchange, None, step_id, caps)
            else:
                # weight 0 would make an all-zero group divide by zero; a tiny weight changes nothing
                gathered = self._all_reduce(
                    group_size, weight=max(float(local_samples), MIN_WEIGHT), named=self.named_group(step_id, caps)
                )
            if gathered is None and not self.closing:
                # Stepping on local gradients would part this replica from the others for good (sync
                # mode never averages parameters). Skipping keeps them equal: the gradients stay
                # accumulated and the next commit averages them with the next step's.
                logger.warning(
                    f"stage {self.runtime.stage}: no averaging round with the other replicas; "
                    f"not stepping, the gradients carry over to the next commit"
                )
            if gathered is None:
                return AveragingOutcome(False, 1, 0, stepped=False)
        if not (round_has_samples(gathered) if gathered else local_samples > 0):
            return AveragingOutcome(gathered is not None, len(gathered or {0: 0}), 0, stepped=False)
        total = samples_in_round(gathered, caps) if gathered else local_samples
        return AveragingOutcome(gathered is not None, len(gathered) if gathered else 1, total, stepped=True)

    def _named_round(
        self, rounds: GlooRounds | SyncExchange, rendezvous: str | None, step_id: str, caps: Mapping[str, int]
    ) -> dict | None:
        """The named group's round over gloo or by exchange, weighted by the trainer's counts:
        hivemind's gathered data (peer -> weight), or None when it failed (counted as hivemind's are)."""
        weights = {p: float(n) for p, n in caps.items()}
        if sum(weights.values()) > 0:
            with self.held_buffers():
                ok = rounds.average(
                    self.flat,
                    leader=rendezvous,
                    step_id=step_id,
                    me=self.averager.peer_id.to_base58(),
                    weights=weights,
                    robust=self.robust,
                    tensor_sizes=self.tensor_sizes,
                )
            if not ok:
                self.record_failure()
                return None
        n = len(weights)
        # the exchange and gloo's robust round all-gather: each member's whole buffer to every other one
        # (the exchange's as float32); gloo's plain round is a ring all-reduce, counted as hivemind's
        gathers = isinstance(rounds, SyncExchange) or (self.robust != "none" and n >= 3)
        value_bytes = 4 if isinstance(rounds, SyncExchange) else self.wire_bytes_per_value
        self.record_success(n, each_way=round((n - 1) * self.num_values * value_bytes) if gathers else None)
        return {PeerID.from_base58(p): w for p, w in weights.items()}

    def prepare(self, step_id: str, group_size: int, samples: Mapping[str, int] | None = None) -> AveragingOutcome:
        """Clipping by the global norm, first phase: average as `commit` does, but hold the mean
        gradient instead of stepping. The outcome says `stepped=False`; its `grad_norm_sq` is the held
        gradient's squared norm (None when there is nothing to step on, or it is not finite: the
        step then skips, as `apply_gradients` skips non-finite gradients)."""
        if not self._first_commit_of(step_id):
            return self._repeated(step_id)
        outcome = self.average_gradients(group_size, samples, step_id)
        self.prepared = outcome if outcome.stepped else None
        if self.prepared is None:
            return self._remember(step_id, outcome)
        norm_sq = float(sum(g.double().pow(2).sum() for g in self.averaged_gradients()))
        return self._remember(
            step_id, replace(outcome, stepped=False, grad_norm_sq=norm_sq if math.isfinite(norm_sq) else None)
        )

    def apply_prepared(self, step_id: str, scale: float) -> AveragingOutcome:
        """Clipping's second phase: step on the gradient `prepare` holds, times `scale` (the trainer's
        min(1, max_norm / global norm), the same for every stage). Nothing held (this replica's round
        failed, or it had nothing to step on): no step, as after a plain commit."""
        if not self._first_commit_of(step_id):
            return self._repeated(step_id)
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return self._remember(step_id, AveragingOutcome(False, 1, 0, stepped=False))
        self.runtime.apply_gradients([gradient * scale for gradient in self.averaged_gradients()])
        return self._remember(step_id, prepared)

    def close(self) -> None:
        super().close()
        if self.exchange is not None:  # a round by exchange in flight ends now too
            self.exchange.cancel()

    def averaged_gradients(self) -> list[torch.Tensor]:
        """A copy of the averager's buffers on the stage's device (one transfer for all of them): after
        a round, the group's mean gradients."""
        with self.held_buffers() as buffers:
            return shaped_like(torch.cat([b.reshape(-1) for b in buffers]).to(self.runtime.device), buffers)


def common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The one dtype of `tensors`, or float32 where they mix (a flat buffer holds one)."""
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def shaped_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive slices of the 1-D `flat`, one shaped as each tensor of `like`, in order."""
    sizes = [t.numel() for t in like]
    if sum(sizes) != flat.numel():
        raise ValueError(f"a buffer of {flat.numel()} values cannot hold tensors of {sum(sizes)}")
    return [piece.view(t.shape) for piece, t in zip(flat.split(sizes), like)]


def round_has_samples(gathered: Mapping) -> bool:
    """Whether a sync round's members step on it: some member declared at least one sample. Every
    member sees the same declarations, so all decide alike, whatever each one's trainer saw (its
    weight caps, which differ when several trainers commit, only shape the mean)."""
    return any(float(weight) >= 1.0 for weight in gathered.values())


def samples_in_round(gathered: Mapping, caps: Mapping[str, int] | None) -> int:
    """The samples behind a sync round's mean: each member's weight, capped at what the trainer saw it serve."""
    return sum(
        int(round(capped_weight(w, None if caps is None else caps.get(p.to_base58(), 0)))) for p, w in gathered.items()
    )


class ParameterAveraging(ReplicaAveraging):
    """`periodic` mode: replicas step on their own and average parameters on a schedule (by time:
    `schedule`/`average` from the peer's loop; by steps: `commit` from the commit handler)."""

    mode = "periodic"

    def __init__(
        self,
        runtime: StageRuntime,
        dht: hivemind.DHT,
        model: str,
        *,
        schedule: AveragingSchedule,
        timeout_s: float = 30.0,
        matchmaking_s: float | None = None,
        compression: str = "none",
        outer: OuterSettings | None = None,
        on_round: Callable[[AveragingRound], None] | None = None,
        members: Collection[str] | None = None,
        robust: str = "clip",
        named_groups: bool = False,
    ):
        """`named_groups`: by steps, a round's group is the replicas the trainer's commit names (no
        matchmaking, so no member the trainer did not commit to can join or break it); False: matchmaking."""
        self.runtime, self.rounds_schedule = runtime, schedule
        self.named_groups = named_groups
        self.outer = OuterOptimizer(outer) if outer is not None else None
        if schedule.by_steps:
            runtime.auto_step = False  # one local step per trainer commit, so replicas count steps together
        if matchmaking_s is None:
            # by steps, the replicas arrive together (the trainer commits to all at once), as in sync mode
            matchmaking_s = 0.5 if schedule.by_steps else 1.0
        super().__init__(  # the buffers: a copy of the parameters, taken before each round and written back after it
            dht,
            runtime.params,
            averager_prefix(model, runtime.stage, runtime.num_stages, "params"),
            timeout_s=timeout_s,
            matchmaking_s=matchmaking_s,
            compression=compression,
            on_round=on_round,
            members=members,
            robust=robust,
        )

    def next_round_time(self) -> float:
        """The next multiple of the period in DHT time: every replica picks the same moment."""
        return self.rounds_schedule.next_round_time(get_dht_time())

    def round_due_after_next_step(self) -> bool:
        """By steps: whether the next commit's step is followed by a round (read on the event loop;
        only commits change the step count in this mode)."""
        return self.rounds_schedule.due_after_step(self.runtime.steps_done + 1)

    def commit(self, step_id: str, group_size: int, replicas: Collection[str] | None = None) -> AveragingOutcome:
        """By steps: take the local step on what this replica accumulated during the trainer's step,
        then, after every K-th step, average parameters with the other replicas (`group_size` of
        them, this one included). A repeated commit (a trainer retry) steps only once. A replica
        that saw no sample of the step still counts it, so its step count stays aligned.
        `replicas`: the group the commit names (this one among them), equal weights, no matchmaking."""
        if not self._first_commit_of(step_id):
            return AveragingOutcome(False, 1, 0, stepped=False)
        samples = self.runtime.samples_accumulated
        if samples > 0:
            self.runtime.step()
        else:
            self.runtime.count_empty_step()
        if not self.rounds_schedule.due_after_step(self.runtime.steps_done) or group_size < 2:
            return AveragingOutcome(False, 1, samples, stepped=True)
        named = self.named_group(replicas)
        self._copy_parameters_in()
        gathered = self._all_reduce(len(named[1]) if named else group_size, weight=1.0, named=named)
        outer_stepped = self._after_round(gathered)
        return AveragingOutcome(
            gathered is not None, len(gathered) if gathered else 1, samples, stepped=True, outer_stepped=outer_stepped
        )

    def named_group(self, replicas: Collection[str] | None) -> tuple[bytes, dict] | None:
        """The round's group as a commit names it: keyed by the step count (the same on every replica
        at its K-th step, whichever trainer's commit that was), each member weighing 1; None
        (matchmaking) without names, with `named_groups` off, or a list without this replica."""
        if not self.named_groups or not replicas or len(replicas) < 2:
            return None
        if self.averager.peer_id.to_base58() not in replicas:
            return None
        return named_group_id(f"periodic:{self.runtime.steps_done}", replicas), {p: 1.0 for p in replicas}

    def schedule(self, group_size: int, scheduled_time: float) -> StepControl | None:
        """By time: look for the other replicas in the background; the compute thread goes on
        meanwhile and only stops for the all-reduce itself (`average`). None when alone or if it
        cannot start."""
        if group_size < 2:
            return None
        return self.try_begin_round(group_size, weight=1.0, scheduled_time=scheduled_time, wait_for_trigger=True)

    @staticmethod
    def group_ready(control: StepControl) -> bool:
        """True once matchmaking has formed a group (or given up): time to call `average`."""
        return control.done() or control.stage == AveragingStage.AWAITING_TRIGGER

    def average(self, control: StepControl) -> AveragingOutcome:
        """Run the all-reduce of a scheduled round (on the compute thread: it writes the parameters)."""
        self._copy_parameters_in()
        gathered = self.finish_round(control)
        outer_stepped = self._after_round(gathered)
        return AveragingOutcome(
            gathered is not None, len(gathered) if gathered else 1, 0, stepped=False, outer_stepped=outer_stepped
        )

    def _after_round(self, gathered: dict | None) -> bool:
        """After a successful round: the outer step (if configured; returns whether it stepped), the
        averaged copies written into the parameters, and cached graphs dropped (they hold activations
        of the parameters before the round)."""
        if gathered is None:
            return False
        stepped = False
        with self.held_buffers() as copies:
            if self.outer is not None:
                stepped = self.outer.apply(copies)
            with torch.no_grad():
                for param, value in zip(self.runtime.params, copies):
                    param.copy_(value)
        self.runtime.cache.clear()
        return stepped

    def _copy_parameters_in(self) -> None:
        """The parameters as they are now, for the all-reduce about to run."""
        with self.held_buffers() as copies, torch.no_grad():
            for copy, param in zip(copies, self.runtime.params):
                copy.copy_(param)

    def abandon(self, control: StepControl) -> None:
        """No group in time (or the peer is stopping): cancel the round and count it as failed."""
        cancel_round(control)
        self.open_rounds.discard(control)
        self.record_failure()
