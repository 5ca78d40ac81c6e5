"""A failed split store is retried with a fresh expiry, which DHT nodes that kept an earlier
attempt accept (they refuse a subkey whose expiry is not later than the one they hold)."""

from __future__ import annotations

import peers.placement.split_claim as split_claim
from dht.records import SplitRecord


def test_each_retry_stores_a_later_expiry_and_the_stored_claim_is_returned(monkeypatch):
    held: list[float] = []  # expiries a node kept; like hivemind's storage it refuses one not later

    def publish(dht, record, *, timeout_s):
        accepted = not held or record.expires_at > held[-1]
        held.append(record.expires_at)
        return accepted and len(held) > 1  # the first attempt is kept somewhere but reported failed

    clock = iter(range(100, 200))
    monkeypatch.setattr(split_claim, "publish_split", publish)
    monkeypatch.setattr(split_claim, "get_dht_time", lambda: float(next(clock)))
    monkeypatch.setattr(split_claim.time, "sleep", lambda s: None)
    claim = SplitRecord(peer_id="p", model="tiny", num_stages=2, boundaries=(0, 2, 3), since=1.0, expires_at=61.0)
    stored = split_claim._publish_with_retries(None, claim, ttl_s=60.0, timeout_s=1.0)
    assert stored is not None and stored.expires_at > claim.expires_at and stored.since == claim.since
    assert len(held) == 2


def test_gives_up_after_the_last_attempt(monkeypatch):
    monkeypatch.setattr(split_claim, "publish_split", lambda dht, record, *, timeout_s: False)
    monkeypatch.setattr(split_claim.time, "sleep", lambda s: None)
    claim = SplitRecord(peer_id="p", model="tiny", num_stages=2, boundaries=(0, 2, 3), since=1.0, expires_at=61.0)
    assert split_claim._publish_with_retries(None, claim, ttl_s=60.0, timeout_s=1.0) is None
