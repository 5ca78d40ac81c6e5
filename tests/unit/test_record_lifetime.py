"""A peer's record outlives the gap between two renewals also when DHT writes are slow: each attempt
is stamped afresh (DHT nodes refuse a record that expired on its way), and the lifetime stretches
with the slowest recent write (a loaded machine made live peers lapse, in CI and here)."""

from __future__ import annotations

import asyncio

import pytest
from cryptography.hazmat.primitives import serialization
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.announce import announce
from dht.record_policy import MAX_RECORD_TTL_S
from dht.records import PeerRecord, PeerState
from dht.signing import SigningIdentity, peer_id_of, register
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
    """Answers a first write with a refusal (no node took it) and the next ones with success."""

    def __init__(self):
        self.writes: list[tuple[float, dict]] = []

    def store(self, key, *, subkey, value, expiration_time, return_future):
        assert return_future
        self.writes.append((expiration_time, value))
        future = asyncio.get_running_loop().create_future()
        future.set_result(len(self.writes) > 1)
        return future


def test_a_retried_announcement_is_stamped_afresh_with_the_same_lifetime():
    key = RSAPrivateKey()
    public = serialization.load_ssh_public_key(key.get_public_key().to_bytes())
    identity = SigningIdentity(private_key=key, peer_id=peer_id_of(public))
    dht = RefusingOnceDHT()
    register(dht, identity)
    lifetime_s = 3.0
    record = PeerRecord(
        peer_id=identity.peer_id,
        model="tiny",
        stage=0,
        num_stages=2,
        state=PeerState.ONLINE,
        throughput=10.0,
        expires_at=get_dht_time() + lifetime_s,
    )

    async def scenario():
        stored = await announce(dht, record, timeout_s=5.0)
        return stored, get_dht_time()

    stored, done_at = asyncio.run(scenario())
    assert stored and len(dht.writes) == 2
    (first, first_value), (second, second_value) = dht.writes
    assert second >= first + 0.1  # the retry waited its backoff pause and was stamped after it
    assert second_value["expires_at"] == second and first_value["expires_at"] == first  # record and entry agree
    assert done_at + lifetime_s - 0.5 <= second <= done_at + lifetime_s
