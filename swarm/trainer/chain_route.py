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
per stage: what it was expected to take plus an even share of the chain's surprise,
`chain_shares`), or as a failure where the stage was served by an alternate or the chain failed.
So a replica's speed is what the chains through it took on the trainer's clock, whatever it
announces: a replica 10x slower makes its chains slower and draws fewer of them (before issue #60
chains were settled without a measurement, so the announced throughput decided, and a replica
announcing 1000x drew 239 of 240 chains). The microbatches `--hub-timing-fraction` sends through
the trainer are timed stage by stage as well (swarm/trainer/schedule.py).

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
    its share of the chain's `elapsed_s` (the trainer's clock; 0: no measurement, see `chain_shares`),
    one that did not (an alternate served, or the chain failed: an empty `served_by`) as a failure,
    which keeps the time it was tied up."""
    expected = [
        scheduler.expected_s(candidates[0], CHAIN_TASK, batch_size) if scheduler.measured(candidates[0]) else None
        for scheduler, candidates in zip(schedulers, route)
    ]
    shares_s = chain_shares(max(elapsed_s, 0.0), expected)
    for stage, (scheduler, candidates) in enumerate(zip(schedulers, route)):
        if stage < len(served_by) and served_by[stage] == candidates[0]:
            scheduler.report_success(candidates[0], CHAIN_TASK, batch_size, shares_s[stage])
        else:
            scheduler.report_failure(candidates[0])


MIN_CHAIN_SHARE = 0.05  # the least share of a chain's time a stage's replica is settled with


def chain_shares(elapsed_s: float, expected_s: Sequence[float | None]) -> list[float]:
    """Each stage's share of a chain that took `elapsed_s`, from what its replica was expected to take
    as measured (None: not measured yet, only announced): with every stage measured, its expectation
    plus an even share of the surprise (elapsed minus the sum expected); otherwise the stages not
    measured share evenly what the measured ones were not expected to take (all of it when none is).
    Each within [MIN_CHAIN_SHARE x elapsed, elapsed]. The shares settle where every chain's stages
    add up to its time, and a replica's expected time differs from its stage's others by what its
    chains took more or less: an even split of every chain halved that difference over two stages
    (a 3x slower replica drew 36 chains against 60)."""
    if elapsed_s <= 0.0 or not expected_s:
        return [0.0] * len(expected_s)
    unknown = [e is None for e in expected_s]
    known_s = sum(e for e in expected_s if e is not None)
    if any(unknown):
        rest_s = (elapsed_s - known_s) / sum(unknown)
        shares = [rest_s if e is None else e for e in expected_s]
    else:
        surprise_s = (elapsed_s - known_s) / len(expected_s)
        shares = [e + surprise_s for e in expected_s]
    return [min(max(share, MIN_CHAIN_SHARE * elapsed_s), elapsed_s) for share in shares]


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
