"""Announcing a peer record, and reading the records of a model's stages."""

from __future__ import annotations

import hivemind

from dht.keys import peer_subkey, stage_key
from dht.records import PeerRecord, parse_records
from dht.signing import allowed_peers_of, identity_of, owned_entries
from dht.subkey_records import await_store, lookup, lookup_async, restamping_store


async def announce(dht: hivemind.DHT, record: PeerRecord, *, timeout_s: float = 10.0) -> bool:
    """Store `record` under its stage key for as long as `record.expires_at` is ahead of now, signed
    by this node's identity (so it must be this node's record). Returns whether it was stored. A
    retried attempt is stamped afresh with the same lifetime (`restamping_store`)."""
    identity = identity_of(dht)
    if record.peer_id != identity.peer_id:
        raise ValueError(f"this node is {identity.peer_id} and can only announce its own record, not {record.peer_id}")
    store = restamping_store(
        dht, stage_key(record.model, record.stage), peer_subkey(record.peer_id, identity.owner_marker), record
    )
    return await await_store(
        store, timeout_s=timeout_s, what=f"Announcing {record.state.value} for stage {record.stage}"
    )


def fetch_stage_records(dht: hivemind.DHT, model: str, stage: int, *, timeout_s: float = 10.0) -> list[PeerRecord]:
    """All unexpired records of one stage (blocking; malformed entries are skipped)."""
    return _parse(dht, lookup(dht, stage_key(model, stage), timeout_s=timeout_s), model, stage)


async def fetch_stage_records_async(
    dht: hivemind.DHT, model: str, stage: int, *, timeout_s: float = 10.0
) -> list[PeerRecord]:
    """All unexpired records of one stage; [] (with a warning) when the lookup times out."""
    entries = await lookup_async(dht, stage_key(model, stage), timeout_s=timeout_s, what=f"{model} stage {stage}")
    return _parse(dht, entries or {}, model, stage)


def _parse(dht: hivemind.DHT, entries: dict, model: str, stage: int) -> list[PeerRecord]:
    owned = owned_entries(entries, what=f"{model} stage {stage}", allowed=allowed_peers_of(dht))
    return parse_records(owned, model=model, stage=stage)
