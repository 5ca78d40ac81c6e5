"""From DHT records to the rebalancer's view, and the one place a peer picks a stage to join.

Pure functions, no I/O: the peer (peers/placement/stage_moves.py, peers/launch.py) fetches the records and
calls these. The decisions themselves live in peers/placement/rebalance.py.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from dht.records import MoveClaim, PeerRecord, PeerState
from peers.placement.rebalance import ClaimView, ReplicaView, choose_initial_stage, choose_standby_target

__all__ = ["choose_stage", "choose_standby_stage", "claim_view", "replica_views"]


def replica_views(
    records: Iterable[PeerRecord], num_stages: int, *, me: ReplicaView | None = None
) -> list[ReplicaView]:
    """One view per peer of this split, sorted by peer_id; standby peers (they serve nothing) are left out.

    A peer that moved has a record at its old stage (``offline``, or an older one not yet expired)
    and one at its new stage: the serving one wins, then the one that expires last. ``me``, the
    caller's own state, replaces whatever the DHT says about its stage and state (its local view is
    authoritative there), but not its throughput where the DHT holds its record at that stage: every
    other peer plans with that announced value, and two peers that each planned with their own live
    value and the other's announced one could each find itself the plan's mover (a herd of two).
    """
    chosen: dict[str, PeerRecord] = {}
    for record in records:
        if record.num_stages != num_stages or record.state == PeerState.STANDBY or not record.stage < num_stages:
            continue
        held = chosen.get(record.peer_id)
        rank = (record.state != PeerState.OFFLINE, record.expires_at)
        if held is None or rank > (held.state != PeerState.OFFLINE, held.expires_at):
            chosen[record.peer_id] = record
    views = {peer_id: ReplicaView(peer_id, r.stage, r.throughput, r.state.value) for peer_id, r in chosen.items()}
    if me is not None:
        announced = views.get(me.peer_id)
        if announced is not None and announced.stage == me.stage:
            me = ReplicaView(me.peer_id, me.stage, announced.throughput, me.state)
        views[me.peer_id] = me
    return [views[peer_id] for peer_id in sorted(views)]


def claim_view(claim: MoveClaim) -> ClaimView:
    """A move claim as the claim rule (``peers.placement.rebalance.claim_verdict``) sees it."""
    return ClaimView(
        claim.peer_id,
        claim.from_stage,
        claim.to_stage,
        claim.moves_from,
        claim.moves_to,
        claim.since,
        claim.expires_at,
        claim.active,
    )


def choose_stage(
    records: Iterable[PeerRecord],
    num_stages: int,
    my_throughput: float,
    *,
    planned_stage: int | None = None,
    fits: Collection[int] | None = None,
) -> int:
    """The stage a peer started with ``--stage auto`` joins.

    ``planned_stage``: the stage a planner-published plan on the DHT names for this peer (issue
    #8); when given it wins, so that peers follow the plan rather than each its own greedy choice.
    Otherwise the stage whose gain raises the swarm's bottleneck most (``choose_initial_stage``),
    among ``fits`` (the stages that fit in the peer's memory; None: any).
    """
    if planned_stage is not None:
        if not 0 <= planned_stage < num_stages:
            raise ValueError(f"the plan names stage {planned_stage}, outside [0, {num_stages})")
        return planned_stage
    return choose_initial_stage(replica_views(records, num_stages), num_stages, my_throughput, candidates=fits)


def choose_standby_stage(records: Iterable[PeerRecord], num_stages: int) -> int:
    """The stage a standby peer keeps a warm copy of: the thinnest one (see ``choose_standby_target``)."""
    return choose_standby_target(replica_views(records, num_stages), num_stages)
