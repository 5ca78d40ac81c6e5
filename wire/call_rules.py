"""What a caller does after a failed call: one rule set for every caller of a replica.

The trainer's call to one stage (hub routing), its chained call through every stage (direct
routing) and a peer's hop to the next stage's replica inside a chain all decide by these rules,
so a failure means the same wherever it happens:

- `asks_again`: a call that adds work (a backward: its gradients are accumulated) whose answer was
  lost in transit (`IN_TRANSIT`) may have been applied: it is asked of the same replica once more,
  first, since that replica answers a repeat without adding it twice and another would add it
  again. A timeout of a call that waits on calls further down (a chain, a hop before the last
  stage) is not: the hang may be below, and the repeat would hang the same way; nor is a call the
  caller cut itself (a replica on probation: the repeat would be cut the same way).
- `penalty_for`: how long the replica to blame is avoided: shut out for good (it refuses us), a
  stage ban (it serves another stage), an identity ban (its own answer broke the contract), or a
  ban with backoff (anything else). What a chain's answer says about a replica is a peer's word,
  not the caller's own observation: it earns a ban with backoff at most, or a stage ban.
- `Attempts`: one piece of work's failed attempts: which replicas failed it (not asked again for
  it, but the one `asks_again` names), and whether the retry budget is spent.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from wire.failures import Failure

# Failures where the call may have been computed and only its answer lost: no answer in time, or a
# stream that broke. A refusal or a malformed answer says the peer did not (or should not) count it.
IN_TRANSIT = frozenset({Failure.TIMEOUT, Failure.TRANSPORT})


class Penalty(str, Enum):
    NONE = "none"  # routine (a cache miss): not the replica's failure
    SHUT_OUT = "shut_out"  # it refuses this caller (a private swarm, no credential): never asked again
    BAN = "ban"  # a ban with backoff (wire-level failures, the replica's own errors)
    STAGE_BAN = "stage_ban"  # it answered for another stage: not asked for this one for long
    IDENTITY_BAN = "identity_ban"  # its own answer broke the contract: not asked for anything for long


def refused_as_not_allowed(error_message: str) -> bool:
    """Whether a peer's refusal says that the caller is not on its --allowed-peers (a private swarm)
    or holds no credential of the peer's run that allows the call (peers/serving/admission.py): no
    retry can help, unlike a refusal of one bad request."""
    return "--allowed-peers" in error_message or "not authorized:" in error_message


def asks_again(kind: Failure, *, adds_work: bool, waits_on_others: bool) -> bool:
    """Whether a call that failed as `kind` is asked of the same replica once more before another."""
    if not adds_work or kind not in IN_TRANSIT:
        return False
    return kind == Failure.TRANSPORT or not waits_on_others


def penalty_for(kind: Failure, message: str, *, witnessed: bool) -> Penalty:
    """The penalty of the replica a failure of `kind` is blamed on. `witnessed`: the caller saw the
    failure itself (its own call, the replica's own answer); otherwise another peer reports it."""
    if kind == Failure.CACHE_MISS:
        return Penalty.NONE
    if kind == Failure.REFUSED and refused_as_not_allowed(message):
        return Penalty.SHUT_OUT
    if kind == Failure.WRONG_STAGE:
        return Penalty.STAGE_BAN
    if kind == Failure.GARBAGE and witnessed:
        return Penalty.IDENTITY_BAN
    return Penalty.BAN


@dataclass(frozen=True)
class FailedAttempt:
    peer_id: str
    kind: Failure
    reason: str


class Attempts:
    """The failed attempts of one piece of work (a microbatch's call to a stage, a chain, a hop).

    max_failures: the retry budget: once more attempts than this failed, `spent` is true (None:
        no budget, the caller bounds the attempts otherwise, e.g. by a candidate list).
    adds_work, waits_on_others: the work's kind, for `asks_again`.
    """

    def __init__(self, *, max_failures: int | None = None, adds_work: bool = False, waits_on_others: bool = False):
        if max_failures is not None and max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {max_failures}")
        self.max_failures, self.adds_work, self.waits_on_others = max_failures, adds_work, waits_on_others
        self._failed: list[FailedAttempt] = []
        self._excluded: set[str] = set()
        self._asked_again: set[str] = set()
        self._again: str | None = None

    def failed(
        self, peer_id: str, kind: Failure, reason: str, *, excluded: Iterable[str] | None = None, cut: bool = False
    ) -> None:
        """Count a failed attempt of `peer_id` (the replica called); the replicas in `excluded` (by
        default `peer_id`) are not chosen again for this work. When the rules ask `peer_id` again,
        `take_again` names it next, once per replica and while the budget lasts; never after a call
        the caller `cut` itself (a replica on probation: the repeat would be cut the same way)."""
        self._failed.append(FailedAttempt(peer_id, kind, reason))
        self._excluded.update([peer_id] if excluded is None else excluded)
        self._again = None
        if (
            not self.spent
            and not cut
            and peer_id not in self._asked_again
            and asks_again(kind, adds_work=self.adds_work, waits_on_others=self.waits_on_others)
        ):
            self._asked_again.add(peer_id)
            self._again = peer_id

    def take_again(self) -> str | None:
        """The replica to ask again before any other (then forgotten), or None."""
        again, self._again = self._again, None
        return again

    @property
    def spent(self) -> bool:
        return self.max_failures is not None and len(self._failed) > self.max_failures

    @property
    def attempts_left(self) -> int | None:
        """Attempts still allowed (the first included); None without a budget."""
        return None if self.max_failures is None else max(self.max_failures + 1 - len(self._failed), 0)

    def failed_peers(self) -> set[str]:
        """Replicas not to choose again for this work."""
        return set(self._excluded)

    @property
    def failures(self) -> tuple[FailedAttempt, ...]:
        return tuple(self._failed)

    def reset(self) -> None:
        """Start afresh (after the caller waited for the swarm: a replica that failed may be back)."""
        self._failed.clear()
        self._excluded.clear()
        self._asked_again.clear()
        self._again = None
