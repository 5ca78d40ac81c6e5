"""Downloading a replica's state over two real p2p daemons: a stream that closes before the answer
(it happens now and then on loopback) is asked for once more; a replica's refusal is not."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from peers.compute.checkpoint import CheckpointMeta, serialize_state
from peers.replicas.state_transfer import download_state
from wire.bounded_streams import StreamLimits, serve_bounded
from wire.messages import write_state
from wire.protocol import RPC_STATE, ProtocolError, StateHeader, StateRequest, StreamClosedError

META = CheckpointMeta(model="tiny", stage=1, num_stages=2, steps_done=5)
STATE = serialize_state(META, {"weight": torch.arange(6.0)}, {})
REQUEST = StateRequest(model="tiny", stage=1, num_stages=2)
CASES = {  # how the replica answers its 1st, 2nd, ... call ('close': no message at all; 'cut': half the state)
    "closed once": ["close", "state"],
    "cut once": ["cut", "state"],
    "always closed": ["close"],
    "refused": ["refuse", "state"],
}


def answer(how: str) -> list[runtime_pb2.ExpertResponse]:
    if how == "close":
        return []
    if how == "refuse":
        return list(write_state(StateHeader(error="too many state requests"), b""))
    header = StateHeader(total_bytes=len(STATE), steps_done=META.steps_done)
    return list(write_state(header, STATE[: len(STATE) // 2] if how == "cut" else STATE))[:2]


@pytest.fixture(scope="module")
def downloads() -> dict[str, tuple[object, int]]:
    """Each case's (download result or error, calls the replica saw), over one pair of daemons."""

    async def scenario():
        server = await P2P.create()
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        script, calls, results = [], [0], {}

        async def handler(request, context):
            how = script[min(calls[0], len(script) - 1)]
            calls[0] += 1
            for message in answer(how):
                yield message

        try:
            await serve_bounded(
                server, RPC_STATE, handler, runtime_pb2.ExpertRequest, StreamLimits(), stream_input=False
            )
            for name, answers in CASES.items():
                script[:], calls[0] = answers, 0
                try:
                    result = await download_state(client, server.peer_id.to_base58(), REQUEST, timeout_s=20)
                except ProtocolError as e:
                    result = e
                results[name] = result, calls[0]
            return results
        finally:
            await client.shutdown()
            await server.shutdown()

    return asyncio.run(scenario())


@pytest.mark.parametrize("case", ["closed once", "cut once"])
def test_a_stream_that_closes_early_is_asked_for_again(downloads, case):
    result, calls = downloads[case]
    assert calls == 2, result
    meta, module_state, _ = result
    assert meta == META and torch.equal(module_state["weight"], torch.arange(6.0))


def test_a_replica_that_keeps_closing_the_stream_fails_as_a_closed_stream(downloads):
    result, calls = downloads["always closed"]
    assert isinstance(result, StreamClosedError) and calls == 2


def test_a_refusal_is_not_asked_for_again(downloads):
    result, calls = downloads["refused"]
    assert isinstance(result, ProtocolError) and not isinstance(result, StreamClosedError)
    assert "too many state requests" in str(result) and calls == 1
