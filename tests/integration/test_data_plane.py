"""The data plane (wire/data_plane.py) between real processes: a caller unknown to the peer is refused
on its port before any call, one that the peer knows (by the token it got over p2pd) meets the same
admission guard as over p2pd (size bombs refused at the header, the penalty box by its peer id) and
the same bounds (a frame past the limit refused from its prefix without the peer buffering it, a
frame that stalls closed at the read deadline), while an honest caller is served throughout; and a
peer whose data plane port cannot be reached is trained through p2pd instead, with nothing lost.
(The one-process equality and the kill tests run over the data plane too: test_correctness.py,
test_direct_routing.py, test_failover.py.)"""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
import torch
from hivemind.proto import runtime_pb2

from dht.node import NetworkConfig, start_dht
from models.config import get_model_config
from swarm.trainer.client import StageClient
from tests.integration.processes import stop_together
from tests.integration.test_correctness import served_over
from tests.integration.test_request_bounds import peak_rss_mib, topk_bomb_request
from wire.bounded_streams import StreamLimits
from wire.data_plane import DataPlaneClient
from wire.frames import END_FRAME, MESSAGE, PREFIX, REFUSED, call_frame, hello_frame
from wire.messages import request_messages
from wire.protocol import RPC_BACKWARD, RequestHeader
from wire.tensors import encode_tensor
from wire.tls_connection import client_context

pytestmark = pytest.mark.slow

READ_DEADLINE_S = 3.0


def peer_id_of(peer) -> str:
    return re.search(r"peer (\S+) online", peer.log()).group(1)


def data_plane_port(peer) -> int:
    return int(re.search(r"data plane on \S+ port (\d+)", peer.log()).group(1))


def served(peer, transport: str) -> float:
    return served_over(peer, transport)


async def _aiter(items):
    for item in items:
        yield item


async def answer_of(client: DataPlaneClient, peer_id: str, messages) -> bytes:
    connection = await client.connection(peer_id)
    assert connection is not None, "the data plane did not connect"
    answers = client.call(connection, RPC_BACKWARD, _aiter(messages), runtime_pb2.ExpertResponse, StreamLimits())
    return b"".join([answer.metadata async for answer in answers])


async def refused_on_the_port(port: int, data: bytes) -> bytes:
    """What the peer answers a TLS connection that sends `data` (a hello with a made-up token, or a
    call with no hello at all) before it closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context())
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()


def test_strangers_are_refused_on_the_port_and_a_known_caller_meets_the_guard_and_the_bounds(make_swarm):
    config = get_model_config("tiny")
    swarm = make_swarm(num_stages=2, run=False)  # the test's own client holds no credential of a run
    swarm.start_bootstrap()
    peer = swarm.start_peer(1, "--request-deadline-s", str(READ_DEADLINE_S), "--bad-request-burst", "4")
    swarm.wait_online([peer])
    peer_id, port = peer_id_of(peer), data_plane_port(peer)
    honest_dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True, models=["tiny"])
    attacker_dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True, models=["tiny"])
    targets = torch.randint(0, config.vocab_size, (2, config.seq_len))

    async def scenario():
        honest = StageClient(await honest_dht.replicate_p2p(), model="tiny", num_stages=2)
        attacker = DataPlaneClient(await attacker_dht.replicate_p2p())
        # connected before the first call (a first connection that takes over a second, on a loaded
        # machine, would send that call through p2pd while it is made)
        assert await honest.transport.data_plane.reach(peer_id) and await attacker.reach(peer_id)

        async def honest_backward():
            inputs = torch.randn(2, config.seq_len, config.d_model)
            tensors = [("inputs", encode_tensor(inputs)), ("targets", encode_tensor(targets))]
            outputs, response, _ = await honest.call(
                peer_id, rpc="backward", stage=1, microbatch_id="m", batch_size=2, tensors=tensors, timeout_s=60
            )
            assert outputs["grad_inputs"].shape == (2, config.seq_len, config.d_model) and response.loss > 0

        await honest_backward()
        assert honest.transport.stats.snapshot()["calls"] == {("direct", "made", "backward"): 1}
        before_mib = peak_rss_mib(peer.popen.pid)

        # Strangers: a made-up token, a call without a hello (refused), plain TCP (no TLS: closed).
        assert (await refused_on_the_port(port, hello_frame("made-up-token-" + "x" * 20)))[:1] == bytes([REFUSED])
        assert (await refused_on_the_port(port, call_frame(RPC_BACKWARD) + END_FRAME))[:1] == bytes([REFUSED])
        with socket.create_connection(("127.0.0.1", port), timeout=15) as plain:
            plain.sendall(call_frame(RPC_BACKWARD) + END_FRAME)
            while plain.recv(1 << 16):  # a TLS alert at most, then the close
                pass
        assert served(peer, "direct") == 1  # none of them reached a handler

        # A known caller: a top-k header that declares a gigabyte is refused at the header, as over p2pd,
        assert b"decode to" in await answer_of(attacker, peer_id, topk_bomb_request(config))
        # ...a frame declaring 256 MiB is refused from its prefix, the connection closed,
        connection = await attacker.connection(peer_id)
        connection.write([call_frame(RPC_BACKWARD), PREFIX.pack(MESSAGE, 0, 256 << 20), bytes(1 << 20)])
        with pytest.raises(ConnectionError):
            while True:
                await connection.read(15)
        # ...a frame that stops midway is closed at the read deadline (the peer answers why first),
        connection = await attacker.connection(peer_id)
        started = asyncio.get_running_loop().time()
        connection.write([call_frame(RPC_BACKWARD), PREFIX.pack(MESSAGE, 0, 1000), bytes(100)])
        with pytest.raises(ConnectionError):
            while True:
                await connection.read(15)
        assert asyncio.get_running_loop().time() - started < 3 * READ_DEADLINE_S
        # ...and each of those was a bad request, held against the caller's peer id: past its burst
        # (--bad-request-burst 4), it is refused before its request is read
        header = RequestHeader(rpc="forward", model="tiny", stage=1, num_stages=2, microbatch_id="x", batch_size=1)
        answers = [await answer_of(attacker, peer_id, list(request_messages(header, []))) for _ in range(3)]
        assert any(b"too many bad requests" in answer for answer in answers), answers

        await honest_backward()  # still serving the honest caller, over the data plane
        assert honest.transport.stats.snapshot()["calls"] == {("direct", "made", "backward"): 2}
        grown_mib = peak_rss_mib(peer.popen.pid) - before_mib
        assert grown_mib < 64, f"the peer's peak RSS grew by {grown_mib:.0f} MiB"
        attacker.close()
        honest.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        honest_dht.shutdown()
        attacker_dht.shutdown()
    assert peer.alive
    assert served(peer, "p2pd") == 0 and served(peer, "direct") >= 6


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_whose_data_plane_port_cannot_be_reached_is_trained_through_p2pd(make_swarm, tmp_path):
    swarm = make_swarm(num_stages=2, peer_args=["--target-batch-size", "8", "--averaging", "none"])
    swarm.start_bootstrap()
    # a port map that forwards nothing to the data plane: callers are told a port where nothing listens
    first, unreachable = swarm.start_peer(0), swarm.start_peer(1, "--data-plane-announce-port", str(closed_port()))
    swarm.wait_online([first, unreachable])
    steps, microbatches = 3, 4
    reports = {}
    for routing in ("direct", "hub"):
        report_path = tmp_path / f"{routing}.json"
        trainer = swarm.start_trainer(
            *("--steps", str(steps), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"),
            *("--routing", routing, "--report", str(report_path)),
        )
        assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
        reports[routing] = report = json.loads(report_path.read_text())
        assert report["completed"] and report["microbatches_lost"] == 0, report
    # direct routing: the trainer reached stage 0 directly, whose hops to stage 1 went through p2pd;
    # hub routing: the trainer's calls to stage 1 through p2pd too
    assert reports["direct"]["transports"]["direct"]["calls"] >= (steps - 1) * microbatches
    assert reports["hub"]["transports"]["p2pd"]["calls"] >= steps * microbatches  # the last stage's fused calls
    assert served(unreachable, "direct") == 0 and served(unreachable, "p2pd") >= 2 * steps * microbatches
    assert served(first, "direct") >= steps * microbatches
    stop_together([first, unreachable])
