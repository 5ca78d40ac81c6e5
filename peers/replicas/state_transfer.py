"""Serving a stage's current state to a joining replica, and downloading it.

The state travels as the bytes of a checkpoint (MAGIC + sha256 + payload, see `peers.compute.checkpoint`),
streamed in 1 MiB chunks, so the receiver verifies it exactly as it verifies a file on disk.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from peers.compute.checkpoint import CheckpointError, CheckpointMeta, deserialize_state
from wire.protocol import (
    MAX_STATE_BYTES,
    RPC_STATE,
    STATE_CHUNK_BYTES,
    ProtocolError,
    StateHeader,
    StateRequest,
    decode_header,
    encode_header,
)

logger = logging.getLogger(__name__)


def state_messages(header: StateHeader, data: bytes):
    yield runtime_pb2.ExpertResponse(metadata=encode_header(header))
    for offset in range(0, len(data), STATE_CHUNK_BYTES):
        yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=data[offset : offset + STATE_CHUNK_BYTES])])


async def download_state(
    p2p: P2P, peer_id: str, request: StateRequest, *, timeout_s: float
) -> tuple[CheckpointMeta, dict, dict]:
    """Fetch and verify one replica's state; raises CheckpointError/ProtocolError/TimeoutError."""

    async def fetch() -> bytes:
        message = runtime_pb2.ExpertRequest(uid="state", metadata=encode_header(request))
        stream = await p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer_id), RPC_STATE, message, runtime_pb2.ExpertResponse
        )
        header, chunks, received = None, [], 0
        async for response in stream:
            if header is None:
                header = decode_header(StateHeader, response.metadata)
                if header.error:
                    raise ProtocolError(f"replica {peer_id[-8:]} refused: {header.error}")
                continue
            for part in response.tensors:
                received += len(part.buffer)
                if received > header.total_bytes:
                    raise ProtocolError("the replica sent more state than it announced")
                chunks.append(part.buffer)
        if header is None or received != header.total_bytes:
            raise ProtocolError(f"state transfer from {peer_id[-8:]} ended early ({received} bytes)")
        return b"".join(chunks)

    data = await asyncio.wait_for(fetch(), timeout=timeout_s)
    return deserialize_state(data, f"state from replica {peer_id[-8:]}")


__all__ = ["download_state", "state_messages", "CheckpointError", "MAX_STATE_BYTES"]
