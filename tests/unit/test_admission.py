"""Every RPC the peer host registers passes its one admission guard: the allow list, the penalty box
and the size limit refuse a caller of forward, backward, train_chain, hop_record, commit, state, probe,
dial-back and the data plane's offer alike, each with that RPC's own error answer, and the streamed
ones on the data plane behind the same guard. No network: the host registers on a fake p2p (and a
fake data plane), and the handlers are called with fake contexts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgpack
import torch
from hivemind.proto import runtime_pb2

from dht.node import NetworkConfig
from dht.reachability import DIAL_BACK_FAILED, RPC_REACHABILITY
from peers.config import DataPlaneSettings, PeerConfig, ServingLimits
from peers.metrics import PeerMetrics
from peers.serving.admission import AdmissionGuard, Rpc
from peers.serving.chain_rpc import PieceRefusedError
from peers.serving.host import PeerHost
from wire.failures import Failure
from wire.messages import read_response, unary_request
from wire.protocol import (
    RPC_BACKWARD,
    RPC_CHAIN_PIECE,
    RPC_COMMIT,
    RPC_DATA_PLANE,
    RPC_FORWARD,
    RPC_HOP_RECORD,
    RPC_OUTER_ROUND,
    RPC_PROBE,
    RPC_STATE,
    RPC_SYNC_ROUND,
    RPC_TRAIN_CHAIN,
    HopRecordRequest,
    ResponseHeader,
)
from wire.request_limits import PenaltyBox
from wire.tensors import decode_tensors, encode_tensor

FRIEND = "QmXeJ1gN6Vft1PyTUwGYGtLrLKHg7WXDXpsLdhKJwfmLXs"
STRANGER = "12D3KooWFA18rYgnxD833hzMdmuKhUUEfH7Qjj7eSry19gAMGyHS"
EVERY_RPC = {
    RPC_FORWARD,
    RPC_BACKWARD,
    RPC_TRAIN_CHAIN,
    RPC_CHAIN_PIECE,
    RPC_HOP_RECORD,
    RPC_COMMIT,
    RPC_STATE,
    RPC_OUTER_ROUND,
    RPC_SYNC_ROUND,
    RPC_PROBE,
    RPC_REACHABILITY,
    RPC_DATA_PLANE,
}


class FakeRuntime:
    stage, num_stages, steps_done, cache_hits, cache_misses = 0, 2, 0, 0, 0
    throughput = SimpleNamespace(value=1.0)


class FakeP2P:
    def __init__(self) -> None:
        self.handlers: dict[str, tuple] = {}

    async def add_protobuf_handler(self, name, handler, input_type, *, stream_input=False, stream_output=False):
        self.handlers[name] = (handler, stream_input, stream_output)


class FakeDataPlane:
    """What the guard registers on a data plane (wire/data_plane.py's DataPlaneServer.add_handler)."""

    def __init__(self) -> None:
        self.handlers: dict[str, tuple] = {}

    def add_handler(self, name, handler, request_type, *, stream_input=True):
        self.handlers[name] = (handler, stream_input, True)


def context(peer_id: str) -> SimpleNamespace:
    return SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer_id))


class Stream:
    """A caller's request stream that records how much of it the peer read."""

    def __init__(self, messages: list[runtime_pb2.ExpertRequest]) -> None:
        self.messages, self.read = list(messages), 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> runtime_pb2.ExpertRequest:
        if self.read == len(self.messages):
            raise StopAsyncIteration
        self.read += 1
        return self.messages[self.read - 1]


def registered_host(**limits) -> tuple[PeerHost, FakeP2P]:
    config = PeerConfig(
        model="tiny",
        stage=0,
        network=NetworkConfig(allowed_peers=[FRIEND]),
        serving=ServingLimits(**limits),
        transport=DataPlaneSettings(data_plane=False),  # no listening socket here
    )
    dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "the-peer"))
    host = PeerHost(config, FakeRuntime(), dht, metrics=PeerMetrics())
    # The guard's decisions on hivemind's own stream reading; the bounded reading the host registers
    # streams with (wire/bounded_streams.py) is tested in test_bounded_streams.py and with real peers.
    host.guard.stream_limits = None
    p2p = FakeP2P()
    asyncio.run(host.register_rpcs(p2p))
    return host, p2p


def call(p2p: FakeP2P, rpc: str, caller: str, request: runtime_pb2.ExpertRequest, *more: runtime_pb2.ExpertRequest):
    """The first answer message of `rpc` to `caller`, and the request stream (None for a unary request)."""
    handler, stream_input, stream_output = p2p.handlers[rpc]

    async def run():
        requests = Stream([request, *more]) if stream_input else request
        if stream_output:
            try:
                answers = [message async for message in handler(requests, context(caller))]
            except PieceRefusedError as e:  # a piece's stream ends with the error: the caller reads its text
                answers = [runtime_pb2.ExpertResponse(metadata=msgpack.packb({"error": str(e)}))]
        else:
            answers = [await handler(requests, context(caller))]
        return answers[0], requests if stream_input else None

    return asyncio.run(run())


def error_of(answer: runtime_pb2.ExpertResponse) -> str:
    """The error text of any of the peer's answers (msgpack headers, or the dial-back's JSON)."""
    text = answer.metadata.decode(errors="replace")
    if not text.startswith("{"):
        text = str(msgpack.unpackb(answer.metadata).get("error"))
    return text


def garbage(size: int = 0) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=b"\xc1 not a header", tensors=[runtime_pb2.Tensor(buffer=bytes(size))])


def test_the_host_registers_every_rpc_behind_the_guard():
    _, p2p = registered_host()
    assert set(p2p.handlers) == EVERY_RPC


def test_a_caller_off_the_allow_list_is_refused_by_every_rpc():
    host, p2p = registered_host()
    for rpc in sorted(EVERY_RPC):
        answer, stream = call(p2p, rpc, STRANGER, garbage(), garbage())
        if rpc == RPC_REACHABILITY:  # every failed dial-back reads alike (it must not tell ports apart)
            assert error_of(answer) == f'{{"reachable":false,"error":"{DIAL_BACK_FAILED}"}}', rpc
        else:
            assert "private swarm" in error_of(answer) and STRANGER in error_of(answer), rpc
        if stream is not None:  # read to the end before the answer: answering earlier resets the stream
            assert stream.read == 2, rpc
    # forward, backward and train_chain
    assert host.serving.requests_failed == 3 and host.serving.requests_served == 0


def test_the_data_plane_serves_the_streamed_rpcs_behind_the_same_guard():
    host, p2p = registered_host()
    plane = FakeDataPlane()
    host.guard.register_data_plane(plane, host.rpcs(), runtime_pb2.ExpertRequest)
    streamed = {
        name for name, (_, stream_input, stream_output) in p2p.handlers.items() if stream_input or stream_output
    }
    assert set(plane.handlers) == streamed and RPC_FORWARD in streamed and RPC_TRAIN_CHAIN in streamed
    for rpc in sorted(streamed):
        answer, stream = call(plane, rpc, STRANGER, garbage(), garbage())
        assert "private swarm" in error_of(answer) and STRANGER in error_of(answer), rpc
    assert host.serving.requests_failed == 3 and host.serving.requests_served == 0


def test_an_allowed_caller_reaches_the_handler():
    _, p2p = registered_host()
    answer, _ = call(p2p, RPC_COMMIT, FRIEND, garbage())
    assert "private swarm" not in error_of(answer) and error_of(answer) not in ("", "None")


def test_a_rate_limited_caller_is_refused_by_every_rpc():
    host, p2p = registered_host(bad_request_burst=1, bad_request_refill_per_s=0.001)
    answer, _ = call(p2p, RPC_FORWARD, FRIEND, garbage())  # a bad request spends the burst of one
    assert "too many bad requests" not in error_of(answer)
    for rpc in sorted(EVERY_RPC):
        answer, _ = call(p2p, rpc, FRIEND, garbage())
        if rpc == RPC_REACHABILITY:  # every failed dial-back reads alike
            assert DIAL_BACK_FAILED in error_of(answer), rpc
        else:
            assert "too many bad requests" in error_of(answer), rpc


def test_a_request_over_the_size_limit_is_refused_after_it_was_read():
    limit_mb = 0.001  # 1048 bytes
    host, p2p = registered_host(max_request_mb=limit_mb)
    answer, stream = call(p2p, RPC_FORWARD, FRIEND, garbage(2000), garbage(10), garbage(10))
    assert "more than 1048 bytes" in error_of(answer) and stream.read == 3
    answer, _ = call(p2p, RPC_COMMIT, FRIEND, garbage(2000))
    assert "more than 1048 bytes" in error_of(answer)
    assert host.guard.penalties.refused == 0  # each too-large request costs one token, none refused yet


def test_the_guard_answers_with_the_rpc_own_refusal():
    """A handler that leaves a too-large request to the guard gets the RPC's refusal, not a reset."""
    guard = AdmissionGuard(max_request_bytes=10, penalties=PenaltyBox())

    async def echo(requests, context):  # reads the whole request, then answers
        for message in [message async for message in requests]:
            yield message

    def refuse(error, waited_s):
        return [runtime_pb2.ExpertResponse(metadata=str(error).encode())]

    handler = guard.guarded(Rpc("echo", echo, refuse, stream_input=True, stream_output=True))

    async def run():
        stream = Stream([garbage(8), garbage(8)])
        return [m async for m in handler(stream, context(STRANGER))], stream

    answers, stream = asyncio.run(run())
    assert [a.metadata for a in answers] == [b"the request carries more than 10 bytes (--max-request-mb)"]
    assert stream.read == 2


def test_a_hop_record_goes_only_to_the_trainer_that_drove_the_chain_and_only_for_this_stage():
    host, p2p = registered_host()
    handler = p2p.handlers[RPC_HOP_RECORD][0]
    sent = encode_tensor(torch.arange(6.0).reshape(2, 3), "none")
    host.chains.records.keep("run:0:1", "sent", FRIEND, sent)
    host.chains.records.keep("run:0:2", "sent", "another-trainer", sent)

    def ask(microbatch_id: str, stage: int = 0):
        wanted = HopRecordRequest(model="tiny", stage=stage, num_stages=2, microbatch_id=microbatch_id, side="sent")

        async def run():
            return await read_response(handler(unary_request(wanted), context(FRIEND)), ResponseHeader)

        return asyncio.run(run())

    answer = ask("run:0:1")
    assert answer.header.error is None
    assert torch.equal(decode_tensors(answer.encoded())["outputs"], torch.arange(6.0).reshape(2, 3))
    assert "no record" in ask("run:0:2").header.error  # another trainer's chain: nothing to tell
    refused = ask("run:0:1", stage=1)
    assert refused.header.error_kind == Failure.WRONG_STAGE
