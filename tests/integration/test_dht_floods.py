"""What the DHT holds cannot be flooded or forged (issue #30), on real hivemind DHT nodes: 6,000
unsigned junk subkeys on a stage key do not hide the stage from a new reader, and a plan signed by
an outsider is neither stored by honest nodes nor followed when the run names its plan signers."""

from __future__ import annotations

import asyncio
import functools
import time

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from dht.announce import announce, fetch_stage_records
from dht.keys import plan_key, stage_key
from dht.node import NetworkConfig, start_dht
from dht.plan_record import PlanRecord, fetch_plan, publish_plan
from dht.records import PeerRecord, PeerState

pytestmark = pytest.mark.slow

JUNK_SUBKEYS = 6000


async def _store_junk(dht, node, *, key: str, count: int, expires: float) -> int:
    """Store `count` junk subkeys under `key` (at the nearest nodes and at the attacker's own);
    returns how many the attacker's own storage holds."""
    for start in range(0, count, 500):  # one store request per 500 subkeys (p2pd caps a message at 4 MiB)
        subkeys = [f"12D3KooWjunk{n:06d}".encode() for n in range(start, min(start + 500, count))]
        await node.store_many(
            [key] * len(subkeys), [b"x" * 1000] * len(subkeys), [expires] * len(subkeys), subkeys=subkeys
        )
    held = node.protocol.storage.get(DHTID.generate(source=key))
    return 0 if held is None else len(held.value)


def plan_by(planner_id: str, *, serves: str, created_at: float) -> PlanRecord:
    return PlanRecord(
        model="tiny",
        num_stages=1,
        stages=((serves,),),
        total_s=1.0,
        data_parallel_s=0.5,
        pipeline_s=0.5,
        planner_id=planner_id,
        created_at=created_at,
        expires_at=created_at + 600,
    )


def test_junk_subkeys_do_not_hide_a_stage_and_an_outsiders_plan_is_ignored():
    nodes = []
    try:
        bootstrap = start_dht(NetworkConfig(), models=["tiny"])
        nodes.append(bootstrap)
        initial_peers = [str(m) for m in bootstrap.get_visible_maddrs()]
        planner = start_dht(NetworkConfig(initial_peers=initial_peers), models=["tiny"])
        nodes.append(planner)
        planner_id = planner.peer_id.to_base58()
        # Every honest node names the run's plan signer; the bootstrap was started before the planner
        # existed, so it stores any signed plan (the readers still follow only the named signer).
        guarded = NetworkConfig(initial_peers=initial_peers, plan_signers=[planner_id])
        victim = start_dht(guarded, models=["tiny"])
        nodes.append(victim)
        victim_id = victim.peer_id.to_base58()
        record = PeerRecord(
            peer_id=victim_id,
            model="tiny",
            stage=0,
            num_stages=2,
            state=PeerState.ONLINE,
            throughput=5.0,
            expires_at=get_dht_time() + 300,
        )
        assert asyncio.run(announce(victim, record))
        assert publish_plan(planner, plan_by(planner_id, serves="honest-peer", created_at=get_dht_time()))

        # An outsider: a raw hivemind node (no validators of its own) floods the stage key...
        attacker = hivemind.DHT(initial_peers=initial_peers, start=True)
        nodes.append(attacker)
        junk = functools.partial(
            _store_junk, key=stage_key("tiny", 0), count=JUNK_SUBKEYS, expires=get_dht_time() + 300
        )
        stored = attacker.run_coroutine(junk)
        assert stored >= JUNK_SUBKEYS, f"the attacker holds {stored} junk subkeys itself: the test proves nothing"
        # ...and an outsider with a signing identity publishes a newer plan that steers the victim.
        outsider = start_dht(NetworkConfig(initial_peers=initial_peers))
        nodes.append(outsider)
        forged = plan_by(outsider.peer_id.to_base58(), serves=victim_id, created_at=get_dht_time() + 1)
        publish_plan(outsider, forged)

        # Honest nodes that guard the model's keys stored none of the junk.
        for node in (bootstrap, victim, planner):
            found = node.get(stage_key("tiny", 0), latest=True, return_future=True).result(timeout=15)
            local = found.value if found is not None and isinstance(found.value, dict) else {}
            assert len(local) <= 2, f"an honest node holds {len(local)} subkeys under the stage key"
        victim_view = victim.get(plan_key("tiny"), latest=True, return_future=True).result(timeout=15)
        assert victim_view is None or len(victim_view.value) == 1, "the victim stored the outsider's plan"

        # A new trainer finds the stage at once, and a --plan-signers reader follows the honest plan.
        reader = start_dht(guarded, client_mode=True, models=["tiny"])
        nodes.append(reader)
        started = time.monotonic()
        records = fetch_stage_records(reader, "tiny", 0, timeout_s=20)
        assert [(r.peer_id, r.state) for r in records] == [(victim_id, PeerState.ONLINE)]
        assert time.monotonic() - started < 20
        followed = fetch_plan(reader, "tiny", timeout_s=20)
        assert followed is not None and followed.planner_id == planner_id, followed
    finally:
        for node in nodes:
            node.shutdown()
