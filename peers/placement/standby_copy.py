"""How fresh a standby peer's copy of its stage is: when to download it again, and what to say when
it must take over from that copy because no replica is left to send the stage's latest state.

Replicas announce the steps their copy holds (`PeerRecord.steps_done`); the standby compares its own
copy with the most any online replica announced. It downloads again only when the stage has moved
on (an idle stage costs nothing) and no more often than a replica answers one caller
(`wire.protocol.STATE_REQUEST_INTERVAL_S`). peers/placement/stage_moves.py runs the loop.
"""

from __future__ import annotations

from collections.abc import Iterable

from dht.records import PeerRecord, PeerState

__all__ = ["announced_steps", "copy_refresh_due", "fallback_warning"]


def announced_steps(records: Iterable[PeerRecord], stage: int, num_stages: int) -> int | None:
    """The most steps an online replica of `stage` announced, or None when none is online."""
    steps = [
        r.steps_done for r in records if r.stage == stage and r.num_stages == num_stages and r.state == PeerState.ONLINE
    ]
    return max(steps, default=None)


def copy_refresh_due(
    *, copy_steps: int, stage_steps: int | None, since_attempt_s: float | None, min_interval_s: float
) -> bool:
    """Download the stage's state again now? Always for a copy never downloaded (`since_attempt_s`
    None); otherwise only when an online replica announced steps the copy lacks and `min_interval_s`
    passed since the last try (a replica refuses a caller that asks more often)."""
    if since_attempt_s is None:
        return True
    return stage_steps is not None and stage_steps > copy_steps and since_attempt_s >= min_interval_s


def fallback_warning(
    *, stage: int, reason: str, copy_steps: int, stage_steps: int, refreshed_s_ago: float | None
) -> str:
    """The one line a standby logs when it takes over from its own copy: how many steps it is behind
    what the stage's replicas last announced (at least that many: they may have stepped since)."""
    age = "never downloaded" if refreshed_s_ago is None else f"downloaded {refreshed_s_ago:.0f} s ago"
    behind = max(stage_steps - copy_steps, 0)
    return (
        f"standby: taking over stage {stage} ({reason}) from its own copy, {behind} steps old "
        f"({copy_steps} steps done, {age}; its replicas last announced {stage_steps}): no live replica "
        f"could send the stage's latest state{', so those steps are lost' if behind else ''}"
    )
