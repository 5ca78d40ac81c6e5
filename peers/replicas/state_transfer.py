"""Downloading a stage's current state from a replica (a joining peer's first step).

The state travels as the bytes of a checkpoint (MAGIC + sha256 + payload, see `peers.compute.checkpoint`),
streamed in 1 MiB chunks (`wire.messages.write_state`/`read_state`), so the receiver verifies it
exactly as it verifies a file on disk.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from peers.compute.checkpoint import CheckpointError, CheckpointMeta, deserialize_state
from wire.messages import read_state, unary_request
from wire.protocol import MAX_STATE_BYTES, RPC_STATE, StateRequest

logger = logging.getLogger(__name__)


async def download_state(
    p2p: P2P, peer_id: str, request: StateRequest, *, timeout_s: float
) -> tuple[CheckpointMeta, dict, dict]:
    """Fetch and verify one replica's state; raises CheckpointError/ProtocolError/TimeoutError."""

    async def fetch() -> bytes:
        stream = await p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer_id), RPC_STATE, unary_request(request), runtime_pb2.ExpertResponse
        )
        return await read_state(stream, sender=peer_id[-8:])

    data = await asyncio.wait_for(fetch(), timeout=timeout_s)
    return deserialize_state(data, f"state from replica {peer_id[-8:]}")


__all__ = ["download_state", "CheckpointError", "MAX_STATE_BYTES"]
