"""The trainer's one call engine: a piece of work attempted until a replica answers, for both routings.

`CallEngine.drive(work)` is the loop that hub routing's call to one stage (`StageCaller.call`,
stage_call.py) and direct routing's chained call (`ChainCaller.run`, chain_call.py) share. Each
hands it a `Work`: how a target (a replica; a route through every stage) is chosen outside the
peers the engine excludes, called, settled and blamed. The loop itself is the same for both:

    choose (or take the target the rules ask again) -> call under the adaptive timeout (and, for
    a target with a replica that never answered this trainer, under its probation) ->
    answered: count it, settle it -> failed: blame the replicas it names and apply the rules of
    wire/call_rules.py (ask again, shut out, ban with backoff, stage or identity ban), count it,
    choose again -> after `max_retries` failed attempts, or when no target can be formed: wait
    for the swarm (refreshing the view) until `stage_wait_timeout_s` runs out, which stops the
    run with an error instead of losing the microbatch.

Probation: a call whose target holds a replica that never answered this trainer, while another
replica of that stage has, is cut once it has taken longer than the probation
(failures.py's `TimeoutPolicy.probation_s`, re-read as the stage's other calls answer) and blamed
on those replicas as a timeout: a short ban and a stall strike, the second in a row a long ban.

`CallCounters` is the one set of counters the trainer keeps (calls, microbatches, spot checks,
commits); the run's report carries the same fields (swarm/trainer/run.py). The decisions are
pure and tested without a network: wire/call_rules.py (the rules), failures.py (timeouts, bans),
routing.py and chain_route.py (whom to call).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from swarm.trainer.client import PeerCallError
from swarm.trainer.config import FailoverSettings
from swarm.trainer.contributions import ContributionLedger
from swarm.trainer.discovery import SwarmView
from swarm.trainer.failures import NotAllowedError, RetriesExhaustedError, RoutingError, TimeoutPolicy
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.service_clock import ServiceClock
from wire.call_rules import Attempts, Penalty
from wire.failures import Failure

logger = logging.getLogger(__name__)

PROBATION_POLL_S = 0.1  # how often a call on probation re-reads its bound while it waits


def _consume(task: asyncio.Task) -> None:
    """Retrieve a cancelled call's outcome, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


@dataclass
class CallCounters:
    """What the trainer's calls did, counted in one place (the report's fields of the same names)."""

    # microbatches (schedule.py)
    microbatches_sent: int = 0
    microbatches_done: int = 0
    microbatches_retried: int = 0  # microbatches that needed at least one retry
    microbatches_hub_timed: int = 0  # direct routing: microbatches sent through the trainer (--hub-timing-fraction)
    # calls (this engine, for both routings)
    calls_retried: int = 0  # failed calls (a chain's hops that failed over included), each retried
    calls_cut_on_probation: int = 0  # ... of which cut: a replica that never answered took longer than its probation
    failures_by_kind: dict[str, int] = field(default_factory=dict)  # a failed call of a replica, by kind
    calls_by_peer: dict[str, int] = field(default_factory=dict)  # answered calls, by peer (last 8 characters)
    backward_inputs_skipped: int = 0  # backwards answered from the peer's activation cache, inputs not resent
    backward_inputs_resent: int = 0  # ... tried without inputs, but the peer had no cached forward
    backward_asked_again: int = (
        0  # backwards (hub) or chains (direct) lost in transit, asked of the same replicas again
    )
    # spot checks (stage_call.py's verify, chain_call.py's audit)
    calls_verified: int = 0  # calls answered by a second replica too (its recompute)
    calls_verified_by_call: dict[str, int] = field(default_factory=dict)  # ... by kind: forward, backward, last
    verify_mismatches: int = 0  # ... whose answers differed beyond the tolerance
    verify_calls: int = 0  # extra calls the spot checks made (second and third replicas), answered or not
    verify_third_opinions: int = 0  # recomputes asked after a mismatch (a third replica's on; at once, or later)
    verify_disputes: int = 0  # mismatches with no third replica to ask: held, nobody banned
    verify_disputes_settled: int = 0  # ... a third replica answered later, before the replicas stepped
    verify_disputes_unresolved: int = 0  # ... none could (listed in the report's `disputes`)
    verify_undecided: int = (
        0  # checks of three or more answers in which no minority showed: each a mismatch, nobody banned
    )
    verify_stale: int = 0  # recomputes not compared: another trainer's commit stepped the replicas in between
    verify_records_missing: int = 0  # chains (direct routing) picked for a check whose hop records could not be had
    verify_largest_agreeing_share: float = 0.0  # the tolerance's margin: the largest share of it two agreeing used
    verify_largest_agreeing_difference: float = 0.0  # ... and the relative difference that was
    banned_peers: dict[str, str] = field(default_factory=dict)  # peer id -> why it was banned for the run
    # commits (schedule.py)
    commits: int = 0  # replicas that stepped on our commit (sync, or periodic every K steps)
    averaged_commits: int = 0  # ... of which averaged with other replicas
    replica_catch_ups: int = 0  # sync replicas that missed a round their partner completed and loaded its state
    sync_round_retries: int = 0  # stages committed again because their averaging round failed on every replica


@dataclass(frozen=True)
class Blame:
    """A replica a failed call is blamed on, and what it earns (wire/call_rules.py's `penalty_for`)."""

    peer_id: str
    stage: int
    kind: Failure
    penalty: Penalty
    reason: str
    at_least_s: float = 0.0  # the shortest ban with backoff (a call that took long is not tried again soon)
    witnessed: bool = True  # this trainer saw the failure itself (False: a peer before it in a chain says so)
    probation: bool = False  # a call cut on probation: a stall strike, never a long ban at the first


class ProbationCut(PeerCallError):
    """A call cut on probation: replicas that never answered this trainer took longer than their
    stage's other replicas' calls allow (`blames`: each of them, as a timeout)."""

    def __init__(self, replicas: list[tuple[int, str]], probation_s: float):
        reason = f"no answer within {probation_s:.2f} s, the probation of a replica that never answered"
        super().__init__(replicas[0][1], Failure.TIMEOUT, reason)
        self.blames = [
            Blame(
                peer_id,
                stage,
                Failure.TIMEOUT,
                Penalty.BAN,
                f"stage {stage}: {peer_id[-8:]}: {reason}",
                at_least_s=3.0 * probation_s,  # as any call's: probing again costs a quarter of the time at most
                probation=True,
            )
            for stage, peer_id in replicas
        ]


class Work(Protocol):
    """One piece of work for `CallEngine.drive`: hub routing's call to a stage, or a chain."""

    stage: int  # where a wait for the swarm is reported
    waiting_for: str  # what a wait waits for, in the line it prints
    rpc: str  # the metrics' label of its calls
    timeout_key: tuple[int, str]  # its slot in the TimeoutPolicy
    adds_work: bool  # a lost answer may have been applied (asked again first: wire/call_rules.py)
    waits_on_others: bool  # its callee calls others before it answers

    def choose(self, exclude: Callable[[int], set[str]]) -> Any | None: ...

    def again(self, peer_id: str) -> Any | None: ...

    def key(self, target: Any) -> str: ...

    def expected_s(self, target: Any) -> float | None: ...

    def replicas(self, target: Any) -> list[tuple[int, str]]: ...  # (stage, replica) the target calls first

    async def call(self, target: Any, timeout_s: float) -> Any: ...

    def failed(self, target: Any, error: PeerCallError, started: float, done: float) -> list[Blame]: ...

    def answered(self, target: Any, result: Any, started: float, done: float) -> Any: ...

    def unavailable(self, waited_s: float, attempts: Attempts) -> RoutingError: ...


class CallEngine:
    """What every call of this trainer shares: the view, the timeouts, the trainer's own clock of
    each replica, the counters, the ledger of contributions, the peers that refuse us."""

    def __init__(self, view: SwarmView, failover: FailoverSettings, *, say=print, my_peer_id: Callable[[], str]):
        self.view = view
        self.max_retries, self.stage_wait_timeout_s = failover.max_retries, failover.stage_wait_timeout_s
        self.timeouts = TimeoutPolicy()
        self.service = ServiceClock()  # routing's measure of each replica: the trainer's own clock
        self.counters = CallCounters()
        self.contributions = ContributionLedger()  # what each peer served, failed, and how checks judged it
        self.not_allowed_by: dict[str, str] = {}  # peers of a private swarm that refused us: never asked again
        self.metrics: TrainerMetrics = view.metrics
        self._say, self._my_peer_id = say, my_peer_id

    def excluded(self, stage: int, attempts: Attempts | None = None) -> set[str]:
        """The replicas of `stage` not to call now: banned, protocol violators, those that refuse us,
        and those that already failed this work."""
        out = self.view.bans.banned() | self.view.violations.banned(stage) | self.not_allowed_by.keys()
        return out | attempts.failed_peers() if attempts is not None else out

    async def drive(self, work: Work, failures: list[str]):
        """Attempt `work` until a target answers; its answer (`work.answered`). Failed attempts are
        appended to `failures`. Raises StageUnavailableError (the swarm could not take it in time)
        or NotAllowedError (every replica left refuses this trainer)."""
        attempts = Attempts(
            max_failures=self.max_retries, adds_work=work.adds_work, waits_on_others=work.waits_on_others
        )
        waited_since = None
        while True:
            target = None
            if attempts.spent:
                logger.warning(str(RetriesExhaustedError(work.stage, attempts.failures)))
            else:
                again = attempts.take_again()
                target = work.again(again) if again is not None else None
                if again is not None and target is not None:
                    self.counters.backward_asked_again += 1
                if target is None:
                    target = work.choose(lambda stage: self.excluded(stage, attempts))
            if target is None:
                if not attempts.spent and self.not_allowed_by:  # no retry lets us into a private swarm
                    raise NotAllowedError(work.stage, self._my_peer_id(), list(self.not_allowed_by.values()))
                waited_since = waited_since or time.monotonic()
                await self.wait(work, waited_since, attempts)
                attempts.reset()
                continue
            waited_since = None
            started = time.perf_counter()
            try:
                # before its latencies are known: what the target is expected to take (failures.py)
                timeout_s = self.timeouts.timeout_s(*work.timeout_key, expected_s=work.expected_s(target))
                unproven = [(stage, p) for stage, p in work.replicas(target) if self._unproven(p)]
                call = work.call(target, timeout_s)
                result = await (self._on_probation(work, call, unproven, started) if unproven else call)
            except PeerCallError as error:
                blames = work.failed(target, error, started, time.perf_counter())
                avoid = [b.peer_id for b in blames]
                if isinstance(error, ProbationCut):  # blamed on the replicas on probation, not on the target
                    self.counters.calls_cut_on_probation += 1
                    blames = error.blames
                    # driven again through replicas that answered, not the next newcomer of those stages
                    avoid = [p for b in blames for p in self.view.schedulers[b.stage].keys_s() if self._unproven(p)]
                self.note_failure(work.rpc, blames)
                if blames and all(b.penalty == Penalty.SHUT_OUT for b in blames):
                    continue  # nothing to retry there, and no failure of the work: it goes elsewhere
                failures.append(str(error))
                self.counters.calls_retried += 1
                cut = isinstance(error, ProbationCut)
                attempts.failed(work.key(target), error.kind, str(error), excluded=avoid, cut=cut)
                logger.info(f"{error}; retrying")
                continue
            done = time.perf_counter()
            self.timeouts.observe(*work.timeout_key, done - started)
            self.metrics.observe_call(stage=work.stage, rpc=work.rpc, duration_s=done - started)
            return work.answered(target, result, started, done)

    async def _on_probation(self, work: Work, call, unproven: list[tuple[int, str]], started: float):
        """`call`'s answer, or ProbationCut once it took longer than the probation while a replica of
        `unproven` has a stage with another replica that answered (the call is then cancelled)."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                pause_s = PROBATION_POLL_S
                probation_s = self.timeouts.probation_s(*work.timeout_key)
                watched = [(stage, p) for stage, p in unproven if self._proven_other(stage, p)]
                if probation_s is not None and watched:
                    left_s = started + probation_s - time.perf_counter()
                    if left_s <= 0.0:
                        raise ProbationCut(watched, probation_s)
                    pause_s = min(pause_s, left_s)
                done, _ = await asyncio.wait({task}, timeout=pause_s)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_consume)

    def _proven_other(self, stage: int, peer_id: str) -> bool:
        """Whether `stage` has a usable replica besides `peer_id` that answered this trainer."""
        others = set(self.view.schedulers[stage].keys_s()) - {peer_id} - self.excluded(stage)
        return any(not self._unproven(other) for other in others)

    def note_failure(self, rpc: str, blames: Sequence[Blame]) -> None:
        """Each blamed replica's failed call, counted (report, metrics, its ledger entry) and penalised."""
        counters, view = self.counters, self.view
        for blame in blames:
            peer_id, stage, kind = blame.peer_id, blame.stage, blame.kind.value
            counters.failures_by_kind[kind] = counters.failures_by_kind.get(kind, 0) + 1
            self.metrics.observe_failure(stage=stage, rpc=rpc, kind=kind)
            if blame.penalty == Penalty.SHUT_OUT:
                self.not_allowed_by[peer_id] = peer_id[-8:]
                continue
            if blame.penalty == Penalty.NONE:
                continue
            self.contributions.failed(peer_id, stage)
            # A protocol violation is the peer's own doing, not bad luck: avoided for long. A wrong-stage
            # answer bans it on this stage (an honest peer that moved serves its new one); a malformed
            # answer of its own bans it everywhere.
            if blame.penalty == Penalty.STAGE_BAN:
                banned_s = view.violations.wrong_stage(peer_id, stage, blame.reason)
                logger.warning(f"stage {stage}: {blame.reason}; not routing stage {stage} there for {banned_s:.0f} s")
                self.contributions.banned(
                    peer_id, stage, f"stage {stage}: {blame.reason} (not asked for stage {stage} for {banned_s:.0f} s)"
                )
            elif blame.penalty == Penalty.IDENTITY_BAN:
                banned_s = view.violations.malformed(peer_id, blame.reason)
                logger.warning(f"stage {stage}: {blame.reason}; not routing anything there for {banned_s:.0f} s")
                self.contributions.banned(
                    peer_id, stage, f"stage {stage}: {blame.reason} (not asked for {banned_s:.0f} s)"
                )
            else:
                strike = self._stall_strike(blame)
                banned_s = view.bans.ban(
                    peer_id,
                    at_least_s=blame.at_least_s,
                    timed_out=strike,
                    unproven=strike and not blame.probation and self._unproven(peer_id),
                )
                if view.bans.stalled(peer_id):  # it kept taking calls and not answering: avoided for long
                    logger.warning(
                        f"stage {stage}: {peer_id[-8:]} timed out again; not routing there for {banned_s:.0f} s"
                    )
                    self.contributions.banned(
                        peer_id, stage, f"stage {stage}: timed out again and again (not asked for {banned_s:.0f} s)"
                    )
            self.metrics.bans.labels(stage=str(stage)).inc()

    def _stall_strike(self, blame: Blame) -> bool:
        """Whether a failure counts toward a stall ban (failures.py's BanList): a timeout this trainer
        saw, or one a peer reports of a replica that never answered this trainer (a peer's word about
        a replica that has served us cannot get it banned for long); never of a stage's only usable
        replica (a lone replica slow under load would stop the run for the ban). A replica that never
        answered is banned for long at its first one (a sybil that joins and stalls costs one timeout)."""
        if blame.kind != Failure.TIMEOUT or not self.view.others_usable(blame.stage, blame.peer_id):
            return False  # not a timeout, or the stage's only usable replica: no long ban
        return blame.witnessed or self._unproven(blame.peer_id)

    def timed_out_unanswered(self, peer_id: str) -> bool:
        """Whether `peer_id` never answered this trainer and timed out since (cut on probation, say):
        the step's commit leaves it out, as it leaves out a replica banned for long (schedule.py)."""
        return self._unproven(peer_id) and self.view.bans.strikes(peer_id) > 0

    def _unproven(self, peer_id: str) -> bool:
        """Whether `peer_id` never answered this trainer: its first stall strike bans it for long."""
        entry = self.contributions.get(peer_id)
        return entry is None or entry.calls_answered == 0

    def note_answered(self, peer_id: str, stage: int, rpc: str, samples: int) -> None:
        """A replica answered a call of ours (or served its stage in a chain that answered)."""
        self.view.bans.clear(peer_id)
        key = peer_id[-8:]
        self.counters.calls_by_peer[key] = self.counters.calls_by_peer.get(key, 0) + 1
        self.contributions.answered(peer_id, stage, rpc, samples)

    async def wait(self, work: Work, since: float, attempts: Attempts) -> None:
        """No target can take `work` now: refresh the view until one can, or give up."""
        waited = time.monotonic() - since
        if waited > self.stage_wait_timeout_s:
            raise work.unavailable(waited, attempts)
        bans = self.view.bans
        if int(waited) % 10 == 0:
            self._say(f"waiting for {work.waiting_for} ({waited:.0f} s so far; {len(bans.banned())} peers banned)")
        next_unban = bans.seconds_until_next_unban()
        pause_s = min(1.0, next_unban if next_unban is not None else 1.0)
        await asyncio.sleep(pause_s)
        self.metrics.stage_wait.labels(stage=str(work.stage)).inc(pause_s)
        await self.view.refresh()
