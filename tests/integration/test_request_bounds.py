"""What a request may cost a real peer (issue #30): a 256 MiB stream message is refused from its
length prefix without the peer buffering it, a stream that stops mid-message is closed at the
read deadline, a top-k header declaring a gigabyte is refused at the header, and the peer keeps
serving an honest caller throughout."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from dht.node import NetworkConfig, start_dht
from models.config import get_model_config
from swarm.trainer.client import PeerCallError, StageClient
from wire.bounded_streams import StreamLimits, iterate_bounded
from wire.failures import Failure
from wire.messages import request_messages
from wire.protocol import RPC_BACKWARD, RPC_FORWARD, RequestHeader
from wire.tensors import encode_tensor

pytestmark = pytest.mark.slow

BIG_MESSAGE_BYTES = 256 << 20
READ_DEADLINE_S = 3.0


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


async def send_one_huge_message(p2p: P2P, peer: PeerID) -> None:
    """hivemind's framing of one 256 MiB message, streamed 1 MiB at a time (the sender holds 1 MiB)."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, RPC_FORWARD)
    try:
        writer.write(P2P.MESSAGE_MARKER + BIG_MESSAGE_BYTES.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        chunk = bytes(1 << 20)
        for _ in range(BIG_MESSAGE_BYTES >> 20):
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), timeout=10)
    except (ConnectionError, TimeoutError, OSError):
        pass  # the peer refused and closed the stream: what we expect
    finally:
        writer.close()


async def stall_mid_message(p2p: P2P, peer: PeerID) -> float:
    """Send half a message and wait: seconds until the peer closes the stream."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, RPC_BACKWARD)
    data = runtime_pb2.ExpertRequest(metadata=b"x" * 1000).SerializeToString()
    writer.write(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data[:100])
    await writer.drain()
    started = asyncio.get_running_loop().time()
    try:
        while await asyncio.wait_for(reader.read(1 << 16), timeout=4 * READ_DEADLINE_S):
            pass  # the peer's answer (an error message), then the end of the stream
    finally:
        writer.close()
    return asyncio.get_running_loop().time() - started


def topk_bomb_request(config) -> list[runtime_pb2.ExpertRequest]:
    from tests.unit.test_size_bombs import topk_bomb

    bomb = topk_bomb()
    header = RequestHeader(
        rpc="backward", model="tiny", stage=1, num_stages=2, microbatch_id="bomb", batch_size=1
    ).model_dump()
    return list(
        request_messages(RequestHeader.model_validate({**header, "tensors": {"inputs": bomb.header}}), bomb.parts)
    )


def test_a_peer_refuses_huge_messages_stalled_streams_and_size_bombs_with_bounded_memory(make_swarm):
    config = get_model_config("tiny")
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    peer = swarm.start_peer(1, "--request-deadline-s", str(READ_DEADLINE_S))
    swarm.wait_online([peer])
    peer_id = peer.log().split("peer ", 1)[1].split(" ", 1)[0]
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True, models=["tiny"])
    targets = torch.randint(0, config.vocab_size, (2, config.seq_len))

    async def scenario():
        p2p = await dht.replicate_p2p()
        client = StageClient(  # the run's own trainer: its backwards are served
            p2p, model="tiny", num_stages=2, credential=swarm.issue_credential(p2p.peer_id.to_base58())
        )

        async def honest_backward():
            inputs = torch.randn(2, config.seq_len, config.d_model)
            tensors = [("inputs", encode_tensor(inputs)), ("targets", encode_tensor(targets))]
            outputs, response, _ = await client.call(
                peer_id, rpc="backward", stage=1, microbatch_id="m", batch_size=2, tensors=tensors, timeout_s=60
            )
            assert outputs["grad_inputs"].shape == (2, config.seq_len, config.d_model) and response.loss > 0

        await honest_backward()
        before_mib = peak_rss_mib(peer.popen.pid)

        await send_one_huge_message(p2p, PeerID.from_base58(peer_id))
        closed_after_s = await stall_mid_message(p2p, PeerID.from_base58(peer_id))
        assert closed_after_s < 3 * READ_DEADLINE_S, closed_after_s
        stream = await iterate_bounded(
            p2p,
            PeerID.from_base58(peer_id),
            RPC_BACKWARD,
            _aiter(topk_bomb_request(config)),
            runtime_pb2.ExpertResponse,
            StreamLimits(),
        )
        answers = [message async for message in stream]
        assert b"decode to" in answers[0].metadata, answers[0].metadata[:300]

        await honest_backward()  # still serving
        grown_mib = peak_rss_mib(peer.popen.pid) - before_mib
        assert grown_mib < 64, f"the peer's peak RSS grew by {grown_mib:.0f} MiB"

    try:
        asyncio.run(scenario())
    except PeerCallError as e:
        assert e.kind != Failure.TIMEOUT, e
        raise
    finally:
        dht.shutdown()
    assert peer.alive


async def _aiter(items):
    for item in items:
        yield item
