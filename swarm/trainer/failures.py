"""What the trainer does about failing calls to replicas, as pure bookkeeping.

- ``TimeoutPolicy``: how long to wait for a call, from the latencies observed so far (before
  enough are known: from the time the replica is expected to take, within bounds), and the
  shorter probation a replica that never answered gets (``probation_s``).
- ``BanList``: how long to avoid a peer after a failure, with exponential backoff; a peer that
  keeps timing out is banned for long (stall strikes), as one that breaks the protocol is.
- ``ProtocolViolations``: peers that broke the protocol, avoided for long.
- The errors the trainer raises when it gives up, each saying what happened and what to do.

The rules every caller applies to a failed call (ask the same replica again, whom to ban and how,
the retry budget) are in wire/call_rules.py, shared with the peers' hops; the trainer's one loop
that applies them is swarm/trainer/call_engine.py. No I/O, no asyncio, time only from an injected
clock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swarm.trainer.routing import Task
from wire.call_rules import FailedAttempt


class RoutingError(RuntimeError):
    """A microbatch could not be pushed through a stage of the swarm."""


class StageUnavailableError(RoutingError):
    """No replica of the stage can take work right now."""

    def __init__(self, stage: int, reason: str) -> None:
        self.stage = stage
        self.reason = reason
        super().__init__(
            f"stage {stage} has no usable replica: {reason}. Start a peer serving stage {stage}, "
            f"or wait: banned peers become usable again when their ban expires."
        )


class NotAllowedError(RoutingError):
    """The stage's replicas refuse this trainer for who it is: a private swarm (`--allowed-peers`)
    that does not list it, or a run (`--run`) for which it holds no credential that allows training."""

    def __init__(self, stage: int, my_peer_id: str, refusals: Sequence[str]) -> None:
        self.stage, self.my_peer_id = stage, my_peer_id
        super().__init__(
            f"refused: stage {stage}'s replicas do not let this trainer, peer {my_peer_id}, train. Either they "
            f"serve a private swarm whose --allowed-peers does not list it (ask its operators to add {my_peer_id}), "
            f"or a run whose owner has not given it a credential (ask for one with `swarm run issue --role trainer "
            f"--peer-id {my_peer_id}` and pass --credential); start this trainer with the same --identity-path each "
            f"time so that its peer id stays the same (refused by {', '.join(sorted(refusals))})"
        )


class RetriesExhaustedError(RoutingError):
    """One microbatch failed at a stage more times than the retry budget allows."""

    def __init__(self, stage: int, failures: Sequence[FailedAttempt]) -> None:
        self.stage = stage
        self.failures = tuple(failures)
        attempts = "; ".join(f"{f.peer_id}: {f.reason}" for f in self.failures)
        super().__init__(
            f"stage {stage}: gave up on a microbatch after {len(self.failures)} failed attempts "
            f"({attempts}). Check those peers' logs and the network between them and this "
            f"trainer; if the failures are transient, raise max_retries."
        )


class TimeoutPolicy:
    """Per-call timeout for each (stage, task), from recently observed latencies.

    timeout = clamp(quantile(latencies, quantile) * margin, floor_s, cap_s); until
    ``min_observations`` latencies have been observed it is ``initial_s``, or, when the caller
    says how long the call is expected to take (the replica's believed throughput, routing.py),
    clamp(expected * first_call_margin, floor_s, initial_s): a replica that stalls from its first
    call costs that, not a minute (three stalling sybils present from the start held a step for
    280 s, issue #60), and one that overstates its speed is held to its word.

    ``probation_s`` is the same bound without the floor (``probation_floor_s`` instead), from the
    latencies known so far (their largest while fewer than ``min_observations``): the call engine
    holds a replica that never answered to it while the call is in flight, once another replica of
    its stage has answered (swarm/trainer/call_engine.py), so that a stalling sybil present from
    the first step costs about three of its stage's calls, not the 5 s floor.

    quantile: in [0, 1]; 0.95 leaves room for the usual tail.
    margin: multiplier on that quantile, so that a slow-but-working peer is not cut off.
    floor_s, cap_s: bounds of the timeout in seconds.
    initial_s: timeout in seconds before enough latencies are known.
    first_call_margin: multiplier on a call's expected time before enough latencies are known (a
        first call may warm up, and an announced throughput is a start-up benchmark's, off by 2x).
    min_observations: latencies needed before the quantile is trusted.
    window: how many recent latencies are kept per (stage, task).
    probation_floor_s: the shortest probation, in seconds.
    """

    def __init__(
        self,
        *,
        quantile: float = 0.95,
        margin: float = 3.0,
        floor_s: float = 5.0,
        cap_s: float = 120.0,
        initial_s: float = 60.0,
        first_call_margin: float = 20.0,
        min_observations: int = 5,
        window: int = 100,
        probation_floor_s: float = 0.5,
    ) -> None:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        if not (math.isfinite(margin) and margin > 0.0):
            raise ValueError(f"margin must be a positive number, got {margin}")
        if not (0.0 < floor_s <= cap_s and math.isfinite(cap_s)):
            raise ValueError(f"need 0 < floor_s <= cap_s < inf, got {floor_s} and {cap_s}")
        if not (math.isfinite(initial_s) and initial_s > 0.0):
            raise ValueError(f"initial_s must be a positive number of seconds, got {initial_s}")
        if not (math.isfinite(first_call_margin) and first_call_margin > 0.0):
            raise ValueError(f"first_call_margin must be a positive number, got {first_call_margin}")
        if not 1 <= min_observations <= window:
            raise ValueError(f"need 1 <= min_observations <= window, got {min_observations} and {window}")
        if not (math.isfinite(probation_floor_s) and probation_floor_s > 0.0):
            raise ValueError(f"probation_floor_s must be a positive number of seconds, got {probation_floor_s}")
        self._quantile = quantile
        self._margin = margin
        self._floor_s = floor_s
        self._cap_s = cap_s
        self._initial_s = initial_s
        self._first_call_margin = first_call_margin
        self._min_observations = min_observations
        self._window = window
        self._probation_floor_s = probation_floor_s
        self._latencies_s: dict[tuple[int, Task], deque[float]] = {}

    def observe(self, stage: int, task: Task, seconds: float) -> None:
        """Record the latency, in seconds, of a call that succeeded."""
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"latency must be a finite number of seconds >= 0, got {seconds}")
        window = self._latencies_s.setdefault((stage, task), deque(maxlen=self._window))
        window.append(seconds)

    def timeout_s(self, stage: int, task: Task, expected_s: float | None = None) -> float:
        """Seconds to wait for the next call to this stage and task; `expected_s`: how long this
        call is expected to take, used until enough latencies are known."""
        latencies_s = self._latencies_s.get((stage, task), ())
        if len(latencies_s) < self._min_observations:
            if expected_s is None or not math.isfinite(expected_s) or expected_s < 0.0:
                return self._initial_s
            return min(max(expected_s * self._first_call_margin, self._floor_s), self._initial_s)
        timeout_s = _quantile(sorted(latencies_s), self._quantile) * self._margin
        return min(max(timeout_s, self._floor_s), self._cap_s)

    def probation_s(self, stage: int, task: Task) -> float | None:
        """Seconds a call to this stage and task may take from a replica that never answered: the
        timeout's bound without its floor, from what is known now; None before any call answered."""
        latencies_s = self._latencies_s.get((stage, task))
        if not latencies_s:
            return None
        if len(latencies_s) < self._min_observations:
            basis_s = max(latencies_s)
        else:
            basis_s = _quantile(sorted(latencies_s), self._quantile)
        return min(max(basis_s * self._margin, self._probation_floor_s), self._cap_s)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    position = q * (len(sorted_values) - 1)
    below = math.floor(position)
    above = min(below + 1, len(sorted_values) - 1)
    fraction = position - below
    return sorted_values[below] + (sorted_values[above] - sorted_values[below]) * fraction


@dataclass
class _BanRecord:
    failures: int
    until_s: float
    timeouts: int = 0  # consecutive incidents that were timeouts (stall strikes)


class BanList:
    """Peers to avoid after failures, with exponential backoff.

    The n-th consecutive failure bans a peer for ``base_s * 2**(n-1)`` seconds, at most ``max_s``,
    and at least ``at_least_s`` when the caller gives one: a failed call that took long (a timeout)
    should not be tried again soon, while one refused at once (connection refused, stream closed)
    costs almost nothing to retry, so a short ``base_s`` lets a peer that had a glitch come back
    quickly without making the trainer wait long on a stage whose every replica is banned.
    Failures reported while the peer is still banned belong to the same incident (calls that
    were in flight together) and neither extend the ban nor double the next one. ``clear`` after
    a success resets the backoff. Bans end by themselves as the clock passes them; a peer's
    failure count is forgotten ``forget_after_s`` after its ban ends, so memory stays bounded
    under churn.

    Timeouts count toward a long ban: the ``stall_strikes``-th consecutive incident that was a
    timeout (no success in between) bans the peer for ``stall_base_s``, doubling with each further
    one up to ``stall_max_s``; the first already, for a peer that never answered (``unproven``). A peer that accepts calls and never answers costs a timeout each time
    it is tried: with the short bans alone, sybils that stalled were tried again every minute at
    most, for good (issue #60), while a wrong answer earns a ban of 15 minutes at once.

    base_s: first ban, in seconds.
    max_s: longest ban, in seconds.
    forget_after_s: seconds after a ban ends until its failure count is forgotten.
    stall_strikes, stall_base_s, stall_max_s: the long bans of peers that keep timing out.
    clock: seconds, monotonic.
    """

    def __init__(
        self,
        *,
        base_s: float = 15.0,
        max_s: float = 300.0,
        forget_after_s: float = 600.0,
        stall_strikes: int = 2,
        stall_base_s: float = 300.0,
        stall_max_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (0.0 < base_s <= max_s and math.isfinite(max_s)):
            raise ValueError(f"need 0 < base_s <= max_s < inf, got base_s={base_s} max_s={max_s}")
        if not (math.isfinite(forget_after_s) and forget_after_s >= 0.0):
            raise ValueError(f"forget_after_s must be a finite number >= 0, got {forget_after_s}")
        if stall_strikes < 1 or not (0.0 < stall_base_s <= stall_max_s and math.isfinite(stall_max_s)):
            raise ValueError("need stall_strikes >= 1 and 0 < stall_base_s <= stall_max_s < inf")
        self._base_s = base_s
        self._max_s = max_s
        self._stall_strikes, self._stall_base_s, self._stall_max_s = stall_strikes, stall_base_s, stall_max_s
        self._forget_after_s = forget_after_s
        self._clock = clock
        self._records: dict[str, _BanRecord] = {}

    def ban(self, peer_id: str, *, at_least_s: float = 0.0, timed_out: bool = False, unproven: bool = False) -> float:
        """Ban the peer after a failure; returns the seconds until the ban ends.

        at_least_s: the shortest ban for this failure (still at most ``max_s``).
        timed_out: the failure was a timeout (the peer took the call and did not answer in time),
            a stall strike.
        unproven: the peer never answered the caller: its first timeout is a stall already."""
        if not (math.isfinite(at_least_s) and at_least_s >= 0.0):
            raise ValueError(f"at_least_s must be a finite number >= 0, got {at_least_s}")
        now_s = self._clock()
        self._forget_old(now_s)
        record = self._records.get(peer_id)
        if record is not None and now_s < record.until_s:
            return record.until_s - now_s
        failures = 1 if record is None else record.failures + 1
        timeouts = (0 if record is None else record.timeouts) + 1 if timed_out else 0
        if timed_out and unproven:
            timeouts = max(timeouts, self._stall_strikes)
        # The exponent is capped so that a long-failing peer cannot overflow the float.
        duration_s = min(max(self._base_s * 2.0 ** min(failures - 1, 64), at_least_s), self._max_s)
        if timeouts >= self._stall_strikes:
            stall_s = self._stall_base_s * 2.0 ** min(timeouts - self._stall_strikes, 64)
            duration_s = max(duration_s, min(stall_s, self._stall_max_s))
        self._records[peer_id] = _BanRecord(failures, now_s + duration_s, timeouts)
        return duration_s

    def stalled(self, peer_id: str) -> bool:
        """Whether the peer is banned now for timing out again and again (stall strikes)."""
        record = self._records.get(peer_id)
        return record is not None and record.timeouts >= self._stall_strikes and self._clock() < record.until_s

    def strikes(self, peer_id: str) -> int:
        """The peer's timeouts in a row that count toward a stall ban (0 once it answered, ``clear``)."""
        record = self._records.get(peer_id)
        return 0 if record is None else record.timeouts

    def is_banned(self, peer_id: str) -> bool:
        record = self._records.get(peer_id)
        return record is not None and self._clock() < record.until_s

    def banned(self) -> set[str]:
        """Peers banned right now."""
        now_s = self._clock()
        self._forget_old(now_s)
        return {p for p, record in self._records.items() if now_s < record.until_s}

    def clear(self, peer_id: str) -> None:
        """Lift any ban and reset the backoff, after the peer served a call successfully."""
        self._records.pop(peer_id, None)

    def seconds_until_next_unban(self) -> float | None:
        """Seconds until the first current ban ends, or None when no peer is banned."""
        now_s = self._clock()
        remaining_s = [r.until_s - now_s for r in self._records.values() if now_s < r.until_s]
        return min(remaining_s, default=None)

    def _forget_old(self, now_s: float) -> None:
        for peer_id in [p for p, r in self._records.items() if now_s >= r.until_s + self._forget_after_s]:
            del self._records[peer_id]


class ProtocolViolations:
    """Peers that broke the protocol, avoided for a long time: not a glitch to retry soon.

    A failure (a timeout, a dropped stream) may be bad luck and earns a short ``BanList`` ban; a
    protocol violation is the peer's own doing: a "wrong stage" answer from a record that names the
    stage, an answer of the wrong shape, NaN or inf, or one that a spot check found in the minority
    (banned for the run). Nine fake records that announced a huge
    throughput and answered "wrong stage" were never banned and cut throughput 100x (issue #30).

    A wrong-stage answer bans the peer on that stage only (an honest peer that moved has left an old
    record behind, and serves its new stage); a malformed answer bans the identity on every stage.
    A success does not lift these bans. Memory stays bounded: at most ``max_peers`` entries, the
    oldest ban forgotten first, and expired ones dropped.

    stage_ban_s: how long a wrong-stage answer bans the peer on that stage.
    identity_ban_s: how long a malformed answer bans the peer everywhere.
    clock: seconds, monotonic.
    """

    def __init__(
        self,
        *,
        stage_ban_s: float = 900.0,
        identity_ban_s: float = 3600.0,
        max_peers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("stage_ban_s", stage_ban_s), ("identity_ban_s", identity_ban_s)):
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self._stage_ban_s, self._identity_ban_s = stage_ban_s, identity_ban_s
        self._max_peers = max_peers
        self._clock = clock
        self._until_s: dict[tuple[str, int | None], float] = {}  # (peer, stage or None = every stage)
        self.reasons: dict[str, str] = {}  # peer -> the latest violation, for logs and reports

    def wrong_stage(self, peer_id: str, stage: int, reason: str) -> float:
        """The peer answered "wrong stage" to a call routed by its own record of `stage`."""
        return self._ban(peer_id, stage, self._stage_ban_s, reason)

    def malformed(self, peer_id: str, reason: str) -> float:
        """The peer's answer broke the contract (shape, dtype, NaN/inf, undecodable)."""
        return self._ban(peer_id, None, self._identity_ban_s, reason)

    def lied(self, peer_id: str, reason: str) -> float:
        """A spot check found the peer's answer in the minority (swarm/trainer/spot_checks.py): a
        plausible lie, on purpose or from broken hardware. Banned everywhere for the rest of the run."""
        return self._ban(peer_id, None, math.inf, reason)

    def banned(self, stage: int) -> set[str]:
        """Peers not to route `stage`'s calls to now."""
        now_s = self._clock()
        self._forget_expired(now_s)
        return {peer for (peer, where), until_s in self._until_s.items() if where in (None, stage) and now_s < until_s}

    def _ban(self, peer_id: str, stage: int | None, duration_s: float, reason: str) -> float:
        now_s = self._clock()
        self._forget_expired(now_s)
        key = (peer_id, stage)
        self._until_s.pop(key, None)  # re-inserted last: the newest ban is forgotten last
        self._until_s[key] = now_s + duration_s
        self.reasons.pop(peer_id, None)
        self.reasons[peer_id] = reason
        while len(self._until_s) > self._max_peers:
            self._forget(next(iter(self._until_s)))
        return duration_s

    def _forget_expired(self, now_s: float) -> None:
        for key in [k for k, until_s in self._until_s.items() if now_s >= until_s]:
            self._forget(key)

    def _forget(self, key: tuple[str, int | None]) -> None:
        del self._until_s[key]
        if not any(peer == key[0] for peer, _ in self._until_s):
            self.reasons.pop(key[0], None)
