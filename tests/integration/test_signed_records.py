"""A peer can write only its own DHT record: forged records for another peer's id are rejected by
the other nodes and skipped by readers (issue #11)."""

from __future__ import annotations

import asyncio
import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.announce import announce, fetch_stage_records
from dht.keys import peer_subkey, stage_key
from dht.node import NetworkConfig, start_dht
from dht.records import PeerRecord, PeerState
from dht.signing import identity_of


def record_of(peer_id: str, *, state: PeerState, throughput: float) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        model="tiny",
        stage=0,
        num_stages=2,
        state=state,
        throughput=throughput,
        expires_at=get_dht_time() + 60,
    )


def entries_seen_by(node, key: str) -> dict:
    result = node.get(key, latest=True, return_future=True).result(timeout=15)
    return result.value if result is not None and isinstance(result.value, dict) else {}


def wait_for(condition, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


@pytest.mark.slow
def test_forged_records_for_another_peer_are_rejected():
    nodes = []
    try:
        bootstrap = start_dht(NetworkConfig())
        nodes.append(bootstrap)
        initial_peers = [str(m) for m in bootstrap.get_visible_maddrs()]
        victim = start_dht(NetworkConfig(initial_peers=initial_peers))
        nodes.append(victim)
        victim_id = victim.peer_id.to_base58()
        assert asyncio.run(announce(victim, record_of(victim_id, state=PeerState.ONLINE, throughput=5.0)))

        # A forger that signs with its own key, and one that runs no validators at all (so its own
        # storage keeps whatever it writes and serves it to readers).
        attacker_key = RSAPrivateKey()
        signing_forger = hivemind.DHT(
            initial_peers=initial_peers, start=True, record_validators=[RSASignatureValidator(attacker_key)]
        )
        raw_forger = hivemind.DHT(initial_peers=initial_peers, start=True)
        nodes += [signing_forger, raw_forger]
        forged = record_of(victim_id, state=PeerState.OFFLINE, throughput=1e9).to_wire()
        key, expires = stage_key("tiny", 0), get_dht_time() + 60
        attacker_marker = RSASignatureValidator(attacker_key).local_public_key
        victim_marker = identity_of(victim).owner_marker
        forgeries = [
            # 1. validly signed, but by a key that is not the victim's identity
            (signing_forger, peer_subkey(victim_id, attacker_marker), expires),
            # 2. the old unsigned subkey format, naming the victim
            (signing_forger, victim_id, expires + 0.5),
            # 3. the victim's own subkey, which the forger cannot sign
            (raw_forger, peer_subkey(victim_id, victim_marker), expires + 1),
        ]
        # Distinct expirations: hivemind's storage heap breaks ties by subkey, and a str subkey beside a
        # bytes one with the same expiration makes the forger's own store raise TypeError.
        stored = []
        for forger, subkey, expiration in forgeries:
            stored.append(
                forger.store(key, subkey=subkey, value=forged, expiration_time=expiration, return_future=True).result(
                    timeout=15
                )
            )
        assert stored[0], "the forger could not even store a record under its own key: the test proves nothing"

        reader = start_dht(NetworkConfig(initial_peers=initial_peers), client_mode=True)
        nodes.append(reader)
        # The raw entries do hold forgery 1 (hivemind accepts it: it is not the victim's subkey, and
        # its signature is valid); the reader must skip it.
        raw = wait_for(lambda: len(entries_seen_by(reader, key)) >= 2 and entries_seen_by(reader, key))
        assert raw and len(raw) == 2, f"expected the real and the forged entry, got {raw}"
        assert all(isinstance(subkey, bytes) for subkey in raw), "an unsigned text subkey got through"
        records = fetch_stage_records(reader, "tiny", 0)
        assert [(r.peer_id, r.state, r.throughput) for r in records] == [(victim_id, PeerState.ONLINE, 5.0)]
        # The other honest nodes refused forgeries 2 (a text subkey) and 3 outright: their view of the victim's subkey is the real one.
        for node in (bootstrap, victim):
            entry = entries_seen_by(node, key).get(peer_subkey(victim_id, victim_marker))
            assert entry is not None and entry.value["state"] == "online"
        # And a node cannot sign a record for another peer id, even by mistake.
        with pytest.raises(ValueError, match="can only announce its own record"):
            asyncio.run(announce(reader, record_of(victim_id, state=PeerState.OFFLINE, throughput=1.0)))
    finally:
        for node in nodes:
            node.shutdown()
