"""Which stage a peer should serve: pure decisions over a snapshot of the swarm's announcements.

A pipeline runs at the speed of its slowest stage, and a stage's throughput is the sum of its
serving (``online`` or ``joining``) replicas' samples/s. Every function takes a snapshot of
announced records (``ReplicaView``), does no I/O, and gives the same answer for the same snapshot,
so peers that read one snapshot agree on who moves.

- ``plan_rebalance``: one deterministic water-filling plan (the thinnest stage takes a peer from
  the fullest); only online peers move, a stage keeps at least one online replica, and the plan is
  carried out only if its bottleneck beats today's by more than ``min_gain``.
- ``claim_verdict``: a peer the plan names claims its move on the DHT and moves only if its claim
  wins, so racing snapshots do not move two peers where one was meant.
- ``peers_settling``, ``SettleWatch``: after a material move, no planning for ``SETTLE_PERIODS``
  and no move back for ``RETURN_PERIODS`` (unless a stage lost a replica).
- ``next_check_delay_s`` spreads checks in time; ``stages_that_lost_replicas`` triggers a check
  as soon as a stage loses a replica.

Every rule with the runs that made it: docs/design/placement.md.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from peers.placement.stage_assignment import optimal_bottleneck

__all__ = [
    "SERVING_STATES",
    "RETURN_PERIODS",
    "SETTLE_PERIODS",
    "SETTLE_SHARE",
    "STATES",
    "MoveDecision",
    "SettleWatch",
    "ClaimVerdict",
    "ClaimView",
    "MOVE_CLAIM_PERIODS",
    "MOVE_CLAIM_WAIT_S",
    "claim_verdict",
    "move_claim_ttl_s",
    "PlannedMove",
    "RebalancePlan",
    "ReplicaView",
    "choose_initial_stage",
    "choose_standby_target",
    "decide_move",
    "decision_in_plan",
    "loss_check_delay_s",
    "next_check_delay_s",
    "peers_settling",
    "settle_share",
    "optimal_bottleneck",
    "plan_rebalance",
    "should_standby_take_over",
    "stage_throughputs",
    "stages_that_lost_replicas",
]

STATES = ("joining", "online", "offline")
SETTLE_PERIODS = 2.0  # check periods a peer waits after it last saw another peer move
SETTLE_SHARE = 0.1  # the least share of its new stage that makes a mover's move one to settle after
RETURN_PERIODS = 10.0  # check periods without a move that undoes a material move (``SettleWatch.return_barred_s``)
SERVING_STATES = frozenset({"joining", "online"})
MOVE_CLAIM_WAIT_S = 3.0  # from storing a move claim to reading the claims back: twice the longest store accepted
MOVE_CLAIM_PERIODS = 3.0  # check periods a move claim lives, besides a few claim waits (``move_claim_ttl_s``)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One peer's announcement as the rebalancer sees it."""

    peer_id: str
    stage: int
    throughput: float
    """Samples/s this peer processes for its stage."""
    state: str
    """``joining`` (downloading state), ``online`` (serving) or ``offline`` (gone)."""


@dataclass(frozen=True, slots=True)
class MoveDecision:
    """What one peer should do after looking at a snapshot."""

    move: bool
    from_stage: int
    to_stage: int | None
    """Target stage if ``move``, else None."""
    current_bottleneck: float
    """min over stages of serving throughput now, samples/s."""
    new_bottleneck: float
    """Bottleneck once the snapshot's coordinated plan has landed (== current if no plan)."""
    reason: str
    moves_from: int = 0
    """If ``move``: how many moves the plan makes out of ``from_stage`` (this one included)."""
    moves_to: int = 0
    """If ``move``: how many moves the plan makes into ``to_stage`` (this one included)."""


@dataclass(frozen=True, slots=True)
class PlannedMove:
    peer_id: str
    from_stage: int
    to_stage: int
    throughput: float


@dataclass(frozen=True, slots=True)
class RebalancePlan:
    """The moves every peer reading the same snapshot agrees on (empty: nobody moves)."""

    moves: tuple[PlannedMove, ...]
    current_bottleneck: float
    planned_bottleneck: float
    reason: str


def _validated(replicas: Sequence[ReplicaView], num_stages: int) -> list[ReplicaView]:
    """The replicas as a list; explanatory ValueError on a malformed snapshot.

    Callers stay order-independent without sorting everything: stage sums use ``math.fsum``
    (exact) and candidate movers are sorted by ``(throughput, peer_id)``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    seen: set[str] = set()
    for r in replicas:
        if not 0 <= r.stage < num_stages:
            raise ValueError(f"{r.peer_id}: stage {r.stage} outside [0, {num_stages})")
        if not math.isfinite(r.throughput) or r.throughput < 0:
            raise ValueError(f"{r.peer_id}: throughput must be finite and >= 0, got {r.throughput}")
        if r.state not in STATES:
            raise ValueError(f"{r.peer_id}: state must be one of {STATES}, got {r.state!r}")
        if r.peer_id in seen:
            raise ValueError(f"duplicate peer_id {r.peer_id!r}: deduplicate records before deciding")
        seen.add(r.peer_id)
    return list(replicas)


def _stage_sums(replicas: Sequence[ReplicaView], num_stages: int) -> list[float]:
    per_stage: list[list[float]] = [[] for _ in range(num_stages)]
    for r in replicas:
        if r.state in SERVING_STATES:
            per_stage[r.stage].append(r.throughput)
    return [math.fsum(xs) for xs in per_stage]  # exact, so independent of input order


def stage_throughputs(replicas: Sequence[ReplicaView], num_stages: int) -> list[float]:
    """Per-stage sum of serving (online + joining) replicas' throughputs, samples/s."""
    return _stage_sums(_validated(replicas, num_stages), num_stages)


def _thinnest_stage(throughputs: Sequence[float]) -> int:
    return min(range(len(throughputs)), key=lambda s: (throughputs[s], s))


def _best_mover_index(speeds: list[float], source_total: float, target_total: float) -> int | None:
    """Index (into ``speeds``, sorted by (speed, peer_id)) of the mover that best evens the two
    stages, i.e. maximises ``min(source - x, target + x)``; ties to the slower peer, then the
    lower peer_id. None if no move leaves both stages above ``target_total``."""
    # min(source - x, target + x) peaks at x = half the difference: check both neighbours.
    peak = bisect.bisect_left(speeds, (source_total - target_total) / 2)
    best: tuple[float, float, int] | None = None  # (-value, x, index)
    for i in (peak - 1, peak):
        if 0 <= i < len(speeds):
            i = bisect.bisect_left(speeds, speeds[i])  # lowest peer_id among equal speeds
            value = min(source_total - speeds[i], target_total + speeds[i])
            if value > target_total and (best is None or (-value, speeds[i], i) < best):
                best = (-value, speeds[i], i)
    return None if best is None else best[2]


def plan_rebalance(replicas: Sequence[ReplicaView], num_stages: int, *, min_gain: float = 0.1) -> RebalancePlan:
    """The coordinated set of moves for this snapshot (see the module docstring for the rules)."""
    if not min_gain >= 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    snapshot = _validated(replicas, num_stages)
    totals = _stage_sums(snapshot, num_stages)
    current = min(totals)
    if num_stages == 1:
        return RebalancePlan((), current, current, "a single stage: nothing to rebalance")
    if current > 0 and math.fsum(totals) / num_stages <= current * (1 + min_gain):
        return RebalancePlan((), current, current, "balanced within min_gain")

    online = [0] * num_stages
    # What a donor can give is its *online* throughput: joining replicas do not serve yet.
    online_totals = _stage_sums([r for r in snapshot if r.state == "online"], num_stages)
    # Per stage, candidate movers sorted by (throughput, peer_id): parallel lists for bisect.
    mover_speeds: list[list[float]] = [[] for _ in range(num_stages)]
    mover_ids: list[list[str]] = [[] for _ in range(num_stages)]
    for r in sorted(snapshot, key=attrgetter("throughput", "peer_id")):
        if r.state == "online":
            online[r.stage] += 1
            if r.throughput > 0:
                mover_speeds[r.stage].append(r.throughput)
                mover_ids[r.stage].append(r.peer_id)

    donors: set[int] = set()
    receivers: set[int] = set()
    moves: list[PlannedMove] = []
    useful_moves = 0  # shortest prefix of ``moves`` that reaches the final bottleneck
    planned = current
    while True:
        target = _thinnest_stage(totals)
        if target in donors:
            break  # raising it would mean moving peers back: the plan has done what it can
        best: tuple[int, int] | None = None  # (source stage, index into its movers)
        # Water-filling: the fullest stage that can give without sinking to the target's level.
        for source in sorted(range(num_stages), key=lambda s: (-online_totals[s], s)):
            if source != target and source not in receivers and online[source] >= 2:
                index = _best_mover_index(mover_speeds[source], online_totals[source], totals[target])
                if index is not None:
                    best = (source, index)
                    break
        if best is None:
            break
        source, i = best
        x, peer_id = mover_speeds[source].pop(i), mover_ids[source].pop(i)
        online[source] -= 1
        online_totals[source] -= x
        totals[source] -= x
        totals[target] += x
        donors.add(source)
        receivers.add(target)
        moves.append(PlannedMove(peer_id, source, target, x))
        if min(totals) > planned:
            planned, useful_moves = min(totals), len(moves)
    # Later steps only lifted stages above the bottleneck (no gain, so no reason to move).
    moves = moves[:useful_moves]

    if current == 0:
        worth_it = planned > 0
    else:
        worth_it = planned > current * (1 + min_gain)
    if not moves or not worth_it:
        return RebalancePlan((), current, current, "no plan beats the bottleneck by min_gain")
    gain = "a stage is empty" if current == 0 else f"+{planned / current - 1:.1%}"
    return RebalancePlan(tuple(moves), current, planned, f"{len(moves)} move(s), bottleneck {gain}")


def decide_move(
    self_peer_id: str,
    replicas: Sequence[ReplicaView],
    num_stages: int,
    *,
    min_gain: float = 0.1,
) -> MoveDecision:
    """Should the peer ``self_peer_id`` move, and where? It moves only if it is in the plan.

    ``replicas`` must include this peer's own record (its local view is authoritative; merge it
    into the DHT snapshot before calling). Raises ValueError on a malformed snapshot.
    """
    me = next((r for r in replicas if r.peer_id == self_peer_id), None)
    if me is None:
        raise ValueError(f"{self_peer_id!r} is not in the snapshot; add its own record first")
    return decision_in_plan(me, plan_rebalance(replicas, num_stages, min_gain=min_gain))


def decision_in_plan(me: ReplicaView, plan: RebalancePlan) -> MoveDecision:
    """``decide_move`` for the peer ``me`` given the snapshot's plan (``plan_rebalance`` of a
    snapshot holding ``me``'s own record): it moves only if the plan names it. Lets a caller
    that decides for many peers over one snapshot (benchmarks/simulate.py) plan once."""
    mine = next((m for m in plan.moves if m.peer_id == me.peer_id), None)
    if mine is not None:
        return MoveDecision(
            True,
            me.stage,
            mine.to_stage,
            plan.current_bottleneck,
            plan.planned_bottleneck,
            f"planned: {plan.reason}",
            moves_from=sum(m.from_stage == mine.from_stage for m in plan.moves),
            moves_to=sum(m.to_stage == mine.to_stage for m in plan.moves),
        )
    if me.state != "online":
        reason = f"{me.state} peers do not move"
    elif plan.moves:
        reason = f"not in this snapshot's plan ({plan.reason})"
    else:
        reason = plan.reason
    return MoveDecision(False, me.stage, None, plan.current_bottleneck, plan.planned_bottleneck, reason)


@dataclass(frozen=True, slots=True)
class ClaimView:
    """A peer's claim to make one move of its plan, as the claim rule sees it (a `MoveClaim` record
    of dht/records.py, or the caller's own claim)."""

    peer_id: str
    from_stage: int
    to_stage: int
    moves_from: int
    """Moves out of ``from_stage`` in the claimant's plan (this one included)."""
    moves_to: int
    """Moves into ``to_stage`` in the claimant's plan (this one included)."""
    since: float
    """DHT time of the claim: earlier claims go first (ties: lower ``peer_id``)."""
    expires_at: float
    active: bool = True
    """False once withdrawn (its peer lost the race, or stopped before moving)."""


@dataclass(frozen=True, slots=True)
class ClaimVerdict:
    wins: bool
    reason: str


def _claim_order(claim: ClaimView) -> tuple[float, str]:
    return claim.since, claim.peer_id


def move_claim_ttl_s(period_s: float) -> float:
    """How long a move claim lives: ``MOVE_CLAIM_PERIODS`` check periods and three claim waits. A
    winner's claim must outlive the reads of peers that snapshot the swarm before its move became
    visible (about two claim waits after the claim), whatever the period."""
    return MOVE_CLAIM_PERIODS * period_s + 3 * MOVE_CLAIM_WAIT_S


def claim_verdict(mine: ClaimView, claims: Sequence[ClaimView], now: float) -> ClaimVerdict:
    """May the peer that claimed ``mine`` make its move, given the claims read back from the DHT
    (``claims``; its own, if there, is ignored)? See "Claims before moves" in the module docstring.

    Only live claims ahead of ``mine`` count (active, unexpired, earlier by ``(since, peer_id)``).
    It loses to one of them that moves the other way through one of its stages (a stage gives or
    receives, never both); and it wins only while fewer claims ahead leave its stage than every
    plan among them and its own allows out of it (``moves_from``), and likewise for the claims
    entering its target (``moves_to``). Every claimant that sees the same claims reaches the same
    verdicts, and the winners out of (into) a stage are never more than any winner's plan makes."""
    ahead = sorted(
        (
            c
            for c in claims
            if c.peer_id != mine.peer_id and c.active and c.expires_at > now and _claim_order(c) < _claim_order(mine)
        ),
        key=_claim_order,
    )
    for claim in ahead:
        if claim.to_stage == mine.from_stage or claim.from_stage == mine.to_stage:
            return ClaimVerdict(
                False,
                f"peer {claim.peer_id[-8:]} claimed a move from stage {claim.from_stage} to stage {claim.to_stage} "
                "first (a stage gives or receives peers, never both)",
            )
    for claims_ahead, planned, what in (
        ([c for c in ahead if c.from_stage == mine.from_stage], "moves_from", f"out of stage {mine.from_stage}"),
        ([c for c in ahead if c.to_stage == mine.to_stage], "moves_to", f"into stage {mine.to_stage}"),
    ):
        allowed = min(getattr(c, planned) for c in (*claims_ahead, mine))
        if len(claims_ahead) >= allowed:
            names = ", ".join(c.peer_id[-8:] for c in claims_ahead)
            return ClaimVerdict(
                False,
                f"peer(s) {names} claimed {len(claims_ahead)} move(s) {what} first, and the plans allow {allowed}",
            )
    return ClaimVerdict(True, f"no earlier claim takes this move's place ({len(ahead)} earlier claim(s) live)")


def choose_initial_stage(
    replicas: Sequence[ReplicaView], num_stages: int, my_throughput: float, *, candidates: Collection[int] | None = None
) -> int:
    """Stage for a peer started with ``--stage auto``: the one whose addition raises the
    bottleneck most, i.e. the thinnest stage (ties: lowest index), among ``candidates`` (None: any)."""
    if not math.isfinite(my_throughput) or my_throughput < 0:
        raise ValueError(f"my_throughput must be finite and >= 0, got {my_throughput}")
    totals = stage_throughputs(replicas, num_stages)

    def bottleneck_if_added(stage: int) -> float:
        return min(t + my_throughput if s == stage else t for s, t in enumerate(totals))

    stages = range(num_stages) if candidates is None else sorted(s for s in candidates if 0 <= s < num_stages)
    if not stages:
        raise ValueError(f"no candidate stage among {num_stages}")
    return min(stages, key=lambda s: (-bottleneck_if_added(s), totals[s], s))


def next_check_delay_s(period_s: float, rng: random.Random) -> float:
    """Seconds until the next rebalancing check: uniform in [0.5, 1.5] * ``period_s``, so that
    peers which started together do not keep checking (and acting) together."""
    if not period_s > 0:
        raise ValueError(f"period_s must be > 0, got {period_s}")
    return rng.uniform(0.5, 1.5) * period_s


def stages_that_lost_replicas(
    previous: Sequence[ReplicaView], current: Sequence[ReplicaView], num_stages: int
) -> tuple[int, ...]:
    """Stages (ascending) where a peer that was *online* in ``previous`` stopped serving by
    ``current``: it announced ``offline`` there or its record expired (absent). A peer seen at
    another stage moved by a plan (not a loss); a joining peer that leaves or an arrival is none."""
    before = _validated(previous, num_stages)
    now = {r.peer_id: r for r in _validated(current, num_stages)}
    lost: set[int] = set()
    for r in before:
        if r.state == "online":
            later = now.get(r.peer_id)
            if later is None or (later.state not in SERVING_STATES and later.stage == r.stage):
                lost.add(r.stage)
    return tuple(sorted(lost))


def peers_settling(
    previous: Sequence[ReplicaView] | None, current: Sequence[ReplicaView], num_stages: int, *, share: float
) -> tuple[str, ...]:
    """Peers (sorted) that moved between two looks at the swarm (serving in both, at different
    stages; an arrival is not a move) and carry at least `share` of their new stage's serving
    throughput in ``current``."""
    before = {r.peer_id: r for r in previous or ()}
    totals = stage_throughputs(current, num_stages)
    moved = set()
    for r in current:
        earlier = before.get(r.peer_id)
        if (
            earlier is not None
            and r.state in SERVING_STATES
            and earlier.state in SERVING_STATES
            and earlier.stage != r.stage
            and r.throughput >= share * totals[r.stage]
        ):
            moved.add(r.peer_id)
    return tuple(sorted(moved))


def settle_share(min_gain: float) -> float:
    """The share of its new stage from which a peer's move makes the others settle."""
    return max(min_gain, SETTLE_SHARE)


@dataclass
class SettleWatch:
    """The settle rule's memory for one peer: the swarm at its last look (``seen``) and the last
    material move it saw (its own included), so that it plans no move for ``settle_s`` after one;
    and when it last saw a material move between each pair of stages, so that it makes no move the
    other way for ``return_s`` (``return_barred_s``)."""

    settle_s: float
    share: float
    return_s: float = 0.0
    seen: list[ReplicaView] | None = None
    last_move_at: float | None = None
    movers: tuple[str, ...] = ()
    moves_seen: dict[tuple[int, int], float] = field(default_factory=dict)
    """(from stage, to stage) -> when a material move between them was last seen or made."""

    def look(self, views: Sequence[ReplicaView], num_stages: int, now: float) -> None:
        """Compare ``views`` with the last look: a material move restarts the settle time."""
        moved = peers_settling(self.seen, views, num_stages, share=self.share)
        if moved:
            before = {r.peer_id: r.stage for r in self.seen or ()}
            after = {r.peer_id: r.stage for r in views}
            self.last_move_at, self.movers = now, moved
            for peer_id in moved:
                self.moves_seen[before[peer_id], after[peer_id]] = now
        self.seen = list(views)

    def moved(self, peer_id: str, now: float, from_stage: int | None = None, to_stage: int | None = None) -> None:
        """This peer just moved (from ``from_stage`` to ``to_stage``): the swarm settles after its own move too."""
        self.last_move_at, self.movers = now, (peer_id,)
        if from_stage is not None and to_stage is not None:
            self.moves_seen[from_stage, to_stage] = now

    def return_barred_s(self, from_stage: int, to_stage: int, now: float) -> float | None:
        """Seconds since a material move from ``to_stage`` to ``from_stage`` while a move back, from
        ``from_stage`` to ``to_stage``, is still barred; None if it is not."""
        since = self.moves_seen.get((to_stage, from_stage))
        if since is None or now - since >= self.return_s:
            return None
        return now - since

    def settling_since(self, now: float) -> float | None:
        """Seconds since the last move while the swarm is still settling; None once it has settled."""
        if self.last_move_at is None or now - self.last_move_at >= self.settle_s:
            return None
        return now - self.last_move_at


def loss_check_delay_s(max_delay_s: float, rng: random.Random) -> float:
    """Seconds from noticing a lost replica to the check it triggers: uniform in
    [0, ``max_delay_s``], so that peers which noticed together do not all read the DHT at once
    (and later readers already see earlier movers as ``joining`` at their new stage)."""
    if not max_delay_s >= 0:
        raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
    return rng.uniform(0.0, max_delay_s)


def choose_standby_target(replicas: Sequence[ReplicaView], num_stages: int) -> int:
    """Stage a standby (backup-pool) peer keeps a warm copy of: the thinnest stage, ties going
    to the stage with fewer online replicas (closer to losing its state), then lowest index."""
    snapshot = _validated(replicas, num_stages)
    totals = _stage_sums(snapshot, num_stages)
    online = [0] * num_stages
    for r in snapshot:
        online[r.stage] += r.state == "online"
    return min(range(num_stages), key=lambda s: (totals[s], online[s], s))


def should_standby_take_over(
    replicas: Sequence[ReplicaView],
    num_stages: int,
    standby_stage: int,
    *,
    min_fraction: float = 0.5,
) -> bool:
    """Should a standby holding ``standby_stage`` start serving it?

    Yes if the stage has no online replica left (its state would otherwise be lost), or if its
    serving throughput fell below ``min_fraction`` of the mean of the other stages.
    """
    if not 0 <= standby_stage < num_stages:
        raise ValueError(f"standby_stage {standby_stage} outside [0, {num_stages})")
    if not 0 <= min_fraction <= 1:
        raise ValueError(f"min_fraction must be in [0, 1], got {min_fraction}")
    snapshot = _validated(replicas, num_stages)
    if not any(r.stage == standby_stage and r.state == "online" for r in snapshot):
        return True
    totals = _stage_sums(snapshot, num_stages)
    others = [t for s, t in enumerate(totals) if s != standby_stage]
    if not others:
        return False
    return totals[standby_stage] < min_fraction * math.fsum(others) / len(others)
