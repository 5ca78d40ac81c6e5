"""A stage's current state between replicas: downloading it (a joining peer's first step) and
exporting it (what a replica answers).

The state travels as the bytes of a checkpoint (MAGIC + sha256 + payload, see `peers.compute.checkpoint`),
streamed in 1 MiB chunks (`wire.messages.write_state`/`read_state`), so the receiver verifies it
exactly as it verifies a file on disk.

A request of a few bytes asks for the whole state, so a replica answers it cheaply (`StateExports`):
at most 4 requests per caller in a row, then one per 10 s; the state serialized once per step, the
compute thread only taking a copy of the tensors (serializing runs on another thread), and
concurrent requests sharing one export. A `digest_only` request gets the header alone: the steps
and the content digest of the state it would send (`fetch_offer`), which a joiner compares across
donors before it downloads one (peers/replicas/donor_choice.py); `download_state` then checks that
what came is the state offered (`expected_digest`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from models.lora import trainable_state_dict
from peers.compute.checkpoint import CheckpointError, CheckpointMeta, deserialize_state, serialize_state
from peers.replicas.donor_choice import StateOffer, state_digest
from wire.bounded_streams import StreamLimits, iterate_bounded
from wire.messages import read_state, read_state_and_header, unary_request
from wire.protocol import (
    MAX_STATE_BYTES,
    RPC_STATE,
    STATE_REQUEST_INTERVAL_S,
    ProtocolError,
    StateRequest,
    StreamClosedError,
)
from wire.request_limits import PenaltyBox

logger = logging.getLogger(__name__)
STATE_TRIES = 2  # one retry: `swarm export` asks each replica up to three times, within its burst of four
RETRY_PAUSE_S = 0.5


async def fetch_offer(p2p: P2P, peer_id: str, request: StateRequest, *, timeout_s: float) -> StateOffer:
    """What `peer_id` would send (its steps and state digest), nothing of the state itself; raises
    ProtocolError/TimeoutError (and what a dead peer's stream raises)."""

    async def fetch() -> StateOffer:
        stream = await iterate_bounded(
            p2p,
            PeerID.from_base58(peer_id),
            RPC_STATE,
            _one(unary_request(request.model_copy(update={"digest_only": True}))),
            runtime_pb2.ExpertResponse,
            StreamLimits(read_timeout_s=timeout_s + 5.0),
        )
        header, _ = await read_state_and_header(stream, sender=peer_id[-8:], max_bytes=0)
        if not header.digest:
            raise ProtocolError(f"replica {peer_id[-8:]} offered its state without a digest")
        return StateOffer(peer_id, header.steps_done, header.digest)

    return await asyncio.wait_for(fetch(), timeout=timeout_s)


async def download_state(
    p2p: P2P,
    peer_id: str,
    request: StateRequest,
    *,
    timeout_s: float,
    max_bytes: int = MAX_STATE_BYTES,
    expected_digest: str | None = None,
) -> tuple[CheckpointMeta, dict, dict]:
    """Fetch and verify one replica's state; raises CheckpointError/ProtocolError/TimeoutError.
    A replica that announces more than `max_bytes` (what such a state can take) is refused at once;
    each message is read within 4 MiB. A stream that closes before the whole state came is asked for
    again (up to STATE_TRIES times in all, within `timeout_s`): the replica's rate limit allows a few.
    `expected_digest`: the state offered (`fetch_offer`); anything else is refused (CheckpointError)."""

    async def fetch() -> bytes:
        stream = await iterate_bounded(
            p2p,
            PeerID.from_base58(peer_id),
            RPC_STATE,
            _one(unary_request(request)),
            runtime_pb2.ExpertResponse,
            StreamLimits(read_timeout_s=timeout_s + 5.0),
        )
        return await read_state(stream, sender=peer_id[-8:], max_bytes=max_bytes)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for attempt in range(1, STATE_TRIES + 1):
        try:
            data = await asyncio.wait_for(fetch(), timeout=max(deadline - loop.time(), 0.0))
            break
        except StreamClosedError as e:  # now and then a p2p stream closes before the answer: ask again
            if attempt == STATE_TRIES or deadline - loop.time() < RETRY_PAUSE_S * attempt:
                raise
            logger.info(f"{e}; asking again ({attempt}/{STATE_TRIES - 1})")
            await asyncio.sleep(RETRY_PAUSE_S * attempt)
    state = deserialize_state(data, f"state from replica {peer_id[-8:]}")
    if expected_digest is not None:
        digest = await loop.run_in_executor(None, state_digest, state[0].steps_done, state[1], state[2])
        if digest != expected_digest:
            raise CheckpointError(
                f"replica {peer_id[-8:]} sent another state ({state[0].steps_done} steps) than the one it offered"
            )
    return state


async def _one(message):
    yield message


def state_bytes_bound(runtime) -> int:
    """The most a state of `runtime`'s stage can take as checkpoint bytes: its trainable tensors
    and up to three optimizer tensors per parameter (Adam: two moments; with a step count), plus
    64 MiB of slack for the format and small state."""
    tensors = trainable_state_dict(runtime.module).values()
    return 4 * sum(t.numel() * t.element_size() for t in tensors) + (64 << 20)


class StateExports:
    """What a replica sends joining replicas, at a bounded cost.

    burst, refill_per_s: state requests one caller may make in a row, and per second after that.
    max_age_s: an export is reused while the runtime has taken no step, for at most this long
        (averaging changes parameters without a step).
    """

    def __init__(
        self,
        *,
        burst: int = 4,  # a joiner's tries, or `swarm export`'s three snapshots of every replica
        refill_per_s: float = 1 / STATE_REQUEST_INTERVAL_S,
        max_age_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.requests = PenaltyBox(burst=burst, refill_per_s=refill_per_s, clock=clock)
        # a digest-only offer (donor choice) has a budget of its own: a joiner's offer and its download
        # then spend one token each, and a standby refreshing every interval keeps up
        self.offers = PenaltyBox(burst=burst, refill_per_s=refill_per_s, clock=clock)
        self.max_age_s, self._clock = max_age_s, clock
        self._cached: tuple[tuple, float, bytes, str] | None = None  # (runtime, stage, steps), made at, bytes, digest
        self._exporting: asyncio.Future | None = None
        self.exports = 0  # serializations made (the others reused one)

    def refusal(self, caller: str, *, offer: bool = False) -> str | None:
        """Why `caller` may not have the state (or, `offer`, its digest) now (its request is counted
        either way), or None."""
        box = self.offers if offer else self.requests
        if not box.allows(caller):
            wait_s = box.seconds_until_allowed(caller)
            return f"too many state requests from {caller[-8:]}; ask again in {wait_s:.0f} s"
        box.penalize(caller)  # every request spends a token
        return None

    def _fresh(self, key: tuple) -> tuple[bytes, int, str] | None:
        if self._cached is None:
            return None
        cached_key, made_at, data, digest = self._cached
        fresh = cached_key == key and self._clock() - made_at <= self.max_age_s
        return (data, key[2], digest) if fresh else None

    async def export(self, runtime, model: str, compute: Executor) -> tuple[bytes, int, str]:
        """The state of `runtime` as checkpoint bytes, the steps it holds, and its content digest."""
        key = (id(runtime), runtime.stage, runtime.steps_done)
        fresh = self._fresh(key)
        if fresh is not None:
            return fresh
        if self._exporting is not None:  # another request is exporting: share its result
            return await asyncio.shield(self._exporting)
        loop = asyncio.get_running_loop()
        self._exporting = loop.create_future()
        try:
            snapshot = await loop.run_in_executor(compute, snapshot_state, runtime, model)
            data, digest = await loop.run_in_executor(None, _serialize_and_digest, snapshot)
            meta = snapshot[0]
            self._cached = ((id(runtime), meta.stage, meta.steps_done), self._clock(), data, digest)
            self.exports += 1
            self._exporting.set_result((data, meta.steps_done, digest))
            return data, meta.steps_done, digest
        except BaseException as e:
            self._exporting.set_exception(e)
            self._exporting.exception()  # retrieved: a failure with nobody sharing it is not "never retrieved"
            raise
        finally:
            self._exporting = None


def _serialize_and_digest(snapshot: tuple[CheckpointMeta, dict, dict]) -> tuple[bytes, str]:
    meta, module_state, optimizer_state = snapshot
    return serialize_state(*snapshot), state_digest(meta.steps_done, module_state, optimizer_state)


def snapshot_state(runtime, model: str) -> tuple[CheckpointMeta, dict, dict]:
    """A copy of `runtime`'s parameters and optimizer state (on the compute thread: a memory copy,
    no serialization), consistent with its `steps_done`."""
    meta = CheckpointMeta(
        model=model, stage=runtime.stage, num_stages=runtime.num_stages, steps_done=runtime.steps_done
    )
    module_state = {name: tensor.detach().clone() for name, tensor in trainable_state_dict(runtime.module).items()}
    return meta, module_state, copy.deepcopy(runtime.optimizer_state())


__all__ = [
    "download_state",
    "fetch_offer",
    "CheckpointError",
    "MAX_STATE_BYTES",
    "StateExports",
    "snapshot_state",
    "state_bytes_bound",
]
