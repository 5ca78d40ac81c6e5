"""Direct routing's route: for each stage of a chained call, the replicas to try, in order.

The trainer picks, before a microbatch starts, the replica of every stage its chain goes through
(`swarm train --routing direct`, swarm/trainer/chain_call.py): the preferred one is each stage's
`ReplicaScheduler.choose` (the same interleaved weighted round-robin as hub routing, charged the
whole forward + cached backward the chain runs there), and behind it up to `alternates` other
replicas, least busy first, that the peer before that stage fails over to. Excluded peers (banned,
failed for this microbatch, refused us) are never named. The peers only walk the lists in order
(peers/serving/chain_rpc.py): the choice stays here.

`settle_route` hands each preferred replica's charge back once the chain answered, with the
trainer's own time of the whole chain as the measure of every replica that served it (its share
per stage: the elapsed time over the number of stages), or as a failure where the stage was served
by an alternate or the chain failed. So a replica's speed is what the chains through it took on the
trainer's clock, whatever it announces: a replica 10x slower makes its chains slower and draws
fewer of them (before issue #60 chains were settled without a measurement, so the announced
throughput decided, and a replica announcing 1000x drew 239 of 240 chains). The chain's other
stages are in every measurement of a stage's replicas alike, so a slow replica's share is somewhat
above its share by its own speed. The microbatches `--hub-timing-fraction` sends through the
trainer are timed stage by stage as well (swarm/trainer/schedule.py).

Pure: no I/O, no asyncio.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from swarm.trainer.routing import ReplicaScheduler
from wire.protocol import HopFailover

CHAIN_TASK = "backward"  # what a chain costs a replica: its forward, then the backward from its cached graph


def choose_route(
    schedulers: Sequence[ReplicaScheduler],
    batch_size: int,
    exclude: Sequence[Collection[str]],
    *,
    alternates: int = 2,
) -> list[list[str]] | None:
    """For each stage (`schedulers[s]`, `exclude[s]`): the preferred replica, then up to `alternates`
    others by their expected busy time (ties by peer id). None, charging nobody, when some stage has
    no replica left to name."""
    if alternates < 0:
        raise ValueError(f"alternates must be at least 0, got {alternates}")
    if len(exclude) != len(schedulers):
        raise ValueError(f"{len(schedulers)} stages but {len(exclude)} exclusion sets")
    free = [
        {p: k for p, k in scheduler.keys_s().items() if p not in excluded}
        for scheduler, excluded in zip(schedulers, exclude)
    ]
    if not all(free):
        return None
    route = []
    for scheduler, excluded, keys in zip(schedulers, exclude, free):
        first = scheduler.choose(CHAIN_TASK, batch_size, exclude=set(excluded))
        others = sorted((k, p) for p, k in keys.items() if p != first)
        route.append([first, *[p for _, p in others[:alternates]]])
    return route


def charge_route(
    schedulers: Sequence[ReplicaScheduler], route: Sequence[Sequence[str]], batch_size: int
) -> list[list[str]] | None:
    """`route` once more, charged as `choose_route` charges a route it chooses (the first replica
    of each stage); None, charging nobody, when a first replica it names is no longer known."""
    if len(route) != len(schedulers) or any(
        not candidates or candidates[0] not in scheduler.keys_s() for scheduler, candidates in zip(schedulers, route)
    ):
        return None
    for scheduler, candidates in zip(schedulers, route):
        scheduler.charge(candidates[0], CHAIN_TASK, batch_size)
    return [list(candidates) for candidates in route]


def settle_route(
    schedulers: Sequence[ReplicaScheduler],
    route: Sequence[Sequence[str]],
    batch_size: int,
    served_by: Sequence[str],
    elapsed_s: float = 0.0,
) -> None:
    """Settle what `choose_route` charged: a preferred replica that served its stage is settled with
    the chain's `elapsed_s` (the trainer's clock; 0: no measurement) over the number of stages as its
    time, one that did not (an alternate served, or the chain failed: an empty `served_by`) as a
    failure, which keeps the time it was tied up."""
    per_stage_s = max(elapsed_s, 0.0) / max(len(route), 1)
    for stage, (scheduler, candidates) in enumerate(zip(schedulers, route)):
        if stage < len(served_by) and served_by[stage] == candidates[0]:
            scheduler.report_success(candidates[0], CHAIN_TASK, batch_size, per_stage_s)
        else:
            scheduler.report_failure(candidates[0])


def failovers_in_route(route: Sequence[Sequence[str]], failovers: Sequence[HopFailover]) -> list[HopFailover]:
    """The failovers a chain's answer reports that fit its route: a later stage's candidate the
    route named for that stage (the trainer calls stage 0 itself), each peer and stage once. What
    else a peer reports is not counted: it could fill the trainer's report and metrics with made-up
    peers and stages."""
    kept, seen = [], set()
    for failover in failovers:
        key = (failover.peer, failover.stage)
        if 0 < failover.stage < len(route) and failover.peer in route[failover.stage] and key not in seen:
            seen.add(key)
            kept.append(failover)
    return kept


def check_served_by(route: Sequence[Sequence[str]], served_by: Sequence[str]) -> str | None:
    """Why a chain's `served_by` does not fit its route (one replica per stage, each a candidate the
    route named for its stage, the first stage's the one called), or None."""
    if len(served_by) != len(route):
        return f"it names {len(served_by)} peers for {len(route)} stages"
    if served_by and served_by[0] != route[0][0]:
        return "it says another peer served the first stage"
    for stage, (peer_id, candidates) in enumerate(zip(served_by, route)):
        if peer_id not in candidates:
            return f"it says stage {stage} was served by {peer_id[-8:]}, which the route did not name"
    return None
