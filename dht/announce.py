"""Announcing a peer record, and reading the records of a model's stages."""

from __future__ import annotations

import asyncio
import logging

import hivemind
from hivemind.utils import get_dht_time

from dht.keys import peer_subkey, stage_key
from dht.records import PeerRecord, parse_records
from dht.signing import allowed_peers_of, identity_of, owned_entries

logger = logging.getLogger(__name__)


async def announce(dht: hivemind.DHT, record: PeerRecord, *, timeout_s: float = 10.0) -> bool:
    """Store `record` under its stage key until `record.expires_at`, signed by this node's identity
    (so it must be this node's record). Returns whether it was stored."""
    identity = identity_of(dht)
    if record.peer_id != identity.peer_id:
        raise ValueError(f"this node is {identity.peer_id} and can only announce its own record, not {record.peer_id}")
    future = dht.store(
        stage_key(record.model, record.stage),
        subkey=peer_subkey(record.peer_id, identity.owner_marker),
        value=record.to_wire(),
        expiration_time=record.expires_at,
        return_future=True,
    )
    try:
        return bool(await asyncio.wait_for(future, timeout=timeout_s))
    except asyncio.TimeoutError:
        future.cancel()
        logger.warning(f"Announcing {record.state.value} for stage {record.stage} timed out after {timeout_s} s")
        return False


def fetch_stage_records(dht: hivemind.DHT, model: str, stage: int, *, timeout_s: float = 10.0) -> list[PeerRecord]:
    """All unexpired records of one stage (blocking; malformed entries are skipped)."""
    result = dht.get(stage_key(model, stage), latest=True, return_future=True).result(timeout=timeout_s)
    return _records_from_result(result, model, stage, allowed_peers_of(dht))


async def fetch_stage_records_async(dht: hivemind.DHT, model: str, stage: int, *, timeout_s: float = 10.0) -> list[PeerRecord]:
    future = dht.get(stage_key(model, stage), latest=True, return_future=True)
    try:
        result = await asyncio.wait_for(future, timeout=timeout_s)
    except asyncio.TimeoutError:
        future.cancel()
        logger.warning(f"DHT lookup of {model} stage {stage} timed out after {timeout_s} s")
        return []
    return _records_from_result(result, model, stage, allowed_peers_of(dht))


def _records_from_result(result, model: str, stage: int, allowed: frozenset[str] | None) -> list[PeerRecord]:
    if result is None or not isinstance(result.value, dict):
        return []
    now = get_dht_time()
    entries = {subkey: item.value for subkey, item in result.value.items() if item.expiration_time > now}
    return parse_records(owned_entries(entries, what=f"{model} stage {stage}", allowed=allowed), model=model, stage=stage)
