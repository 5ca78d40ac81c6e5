"""A peer's record outlives the gap between two renewals also when DHT writes are slow: each attempt
of every record's write is stamped afresh (DHT nodes refuse a record that expired on its way), and
the lifetime stretches with the slowest recent write (a loaded machine made live peers lapse, in CI
and here)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
from cryptography.hazmat.primitives import serialization
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.announce import announce
from dht.link_records import LinkMeasurement, LinkRecord, publish_links_async
from dht.move_claims import publish_move_claim_async
from dht.plan_record import PlanRecord, publish_plan, publish_plan_async
from dht.record_policy import MAX_RECORD_TTL_S
from dht.records import MoveClaim, PeerRecord, PeerState, SplitRecord
from dht.signing import SigningIdentity, peer_id_of, register
from dht.split_agreement import publish_split, publish_split_async
from dht.trainer_progress import TrainerProgress, publish_progress_async
from peers.serving.announcer import record_ttl_s


def test_a_quick_dht_keeps_the_configured_lifetime_give_or_take_one_write():
    assert record_ttl_s(15.0, 5.0, 0.05) == pytest.approx(15.05)
    assert record_ttl_s(3.0, 1.0, 0.0) == 3.0
    assert record_ttl_s(60.0, 5.0, 0.05) == 60.0


def test_slow_writes_stretch_the_lifetime_past_the_gap_between_two_renewals():
    # 1 s periods, writes of up to 2.3 s: renewals start 2.3 s apart and land up to 2.3 s late
    ttl = record_ttl_s(3.0, 1.0, 2.3)
    assert ttl == pytest.approx(3 * 2.3 + 2.3)
    assert ttl > 2.3 + 2.3  # one renewal that starts late and lands late still finds the record alive
    # a write quicker than the period: renewals start a period apart, and the record lives one write longer
    assert record_ttl_s(15.0, 5.0, 1.0) == pytest.approx(16.0)


def test_the_lifetime_never_passes_what_dht_nodes_store():
    assert record_ttl_s(3.0, 1.0, 10_000.0) == MAX_RECORD_TTL_S


class RefusingOnceDHT:
    """Answers a first write with a refusal (no node took it) and the next ones with success; its
    futures are asyncio's inside an event loop and concurrent ones outside it (the blocking writers)."""

    def __init__(self):
        self.writes: list[tuple[float, dict]] = []

    def store(self, key, *, subkey, value, expiration_time, return_future):
        assert return_future
        self.writes.append((expiration_time, value))
        try:
            future = asyncio.get_running_loop().create_future()
        except RuntimeError:
            future = concurrent.futures.Future()
        future.set_result(len(self.writes) > 1)
        return future


def signed_dht() -> tuple[RefusingOnceDHT, str]:
    key = RSAPrivateKey()
    public = serialization.load_ssh_public_key(key.get_public_key().to_bytes())
    identity = SigningIdentity(private_key=key, peer_id=peer_id_of(public))
    dht = RefusingOnceDHT()
    register(dht, identity)
    return dht, identity.peer_id


LIFETIME_S = 3.0


def peer_record(me: str, expires_at: float):
    return PeerRecord(
        peer_id=me, model="tiny", stage=0, num_stages=2, state=PeerState.ONLINE, throughput=10.0, expires_at=expires_at
    )


def link_record(me: str, expires_at: float):
    now = get_dht_time()
    links = {"other": LinkMeasurement(rtt_ms=1.0, bandwidth_gbps=1.0, measured_at=now)}
    return LinkRecord(
        peer_id=me, model="tiny", num_stages=2, throughput=1.0, measured_at=now, expires_at=expires_at, links=links
    )


def progress_record(me: str, expires_at: float):
    return TrainerProgress(peer_id=me, model="tiny", num_stages=2, run="r", step=1, samples=4, expires_at=expires_at)


def move_claim(me: str, expires_at: float):
    return MoveClaim(
        peer_id=me,
        model="tiny",
        num_stages=2,
        from_stage=0,
        to_stage=1,
        moves_from=1,
        moves_to=1,
        since=get_dht_time(),
        expires_at=expires_at,
    )


def split_record(me: str, expires_at: float):
    return SplitRecord(
        peer_id=me, model="tiny", num_stages=2, boundaries=(0, 2, 3), since=get_dht_time(), expires_at=expires_at
    )


def plan_record(me: str, expires_at: float):
    return PlanRecord(
        model="tiny",
        num_stages=1,
        stages=(("a",),),
        total_s=1.0,
        data_parallel_s=0.5,
        pipeline_s=0.5,
        planner_id=me,
        created_at=get_dht_time(),
        expires_at=expires_at,
    )


WRITERS = {  # name: (record of this node, writer, whether it blocks)
    "announce": (peer_record, announce, False),
    "links": (link_record, publish_links_async, False),
    "progress": (progress_record, publish_progress_async, False),
    "move claim": (move_claim, publish_move_claim_async, False),
    "split": (split_record, publish_split_async, False),
    "split, blocking": (split_record, publish_split, True),
    "plan": (plan_record, publish_plan_async, False),
    "plan, blocking": (plan_record, publish_plan, True),
}


@pytest.mark.parametrize("name", WRITERS)
def test_a_retried_write_is_stamped_afresh_with_the_same_lifetime(name):
    make, write, blocking = WRITERS[name]
    dht, me = signed_dht()
    record = make(me, get_dht_time() + LIFETIME_S)

    async def written():
        return await write(dht, record, timeout_s=5.0)

    stored = write(dht, record, timeout_s=5.0) if blocking else asyncio.run(written())
    done_at = get_dht_time()
    assert stored and len(dht.writes) == 2
    (first, first_value), (second, second_value) = dht.writes
    assert second >= first + 0.1  # the retry waited its backoff pause and was stamped after it
    assert second_value["expires_at"] == second and first_value["expires_at"] == first  # record and entry agree
    assert done_at + LIFETIME_S - 0.5 <= second <= done_at + LIFETIME_S
