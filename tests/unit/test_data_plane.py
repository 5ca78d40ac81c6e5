"""The data plane (wire/data_plane.py) over real TLS connections on loopback: calls and their answers
arrive whole, a connection carries one call after another, and a caller is refused before any call
when the peer's certificate is not the one offered, its token is unknown, or it never says who it
is. Frames past the limits, handler errors, deadlines and a peer that dies mid-call end the call as
on a p2pd stream. The control plane (the offer over p2pd, the addresses of p2pd's connections) is a
stand-in here; tests/integration/test_data_plane.py runs the whole of it between real processes."""

from __future__ import annotations

import asyncio
import os
import ssl
import time

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo
from hivemind.proto import runtime_pb2

from wire.bounded_streams import StreamDeadlineError, StreamLimits
from wire.data_plane import DataPlaneClient, DataPlaneServer, Tokens, direct_host
from wire.frames import END_FRAME, REFUSED, call_frame, hello_frame
from wire.messages import unary_response
from wire.protocol import DataPlaneOffer
from wire.tls_connection import MAX_QUEUED_BYTES, client_context

LIMITS = StreamLimits(read_timeout_s=3.0, idle_timeout_s=3.0)
SERVER_ID, CALLER_ID = PeerID(b"\x12\x20" + os.urandom(32)), PeerID(b"\x12\x20" + os.urandom(32))


class ControlPlane:
    """What a DataPlaneClient asks of hivemind's P2P: the peer's offer (answered by `server` for
    CALLER_ID, as its RPC_DATA_PLANE handler would over p2pd) and where p2pd's connections go."""

    def __init__(self, server: DataPlaneServer, *, offer: DataPlaneOffer | None = None, host: str = "127.0.0.1"):
        self.server, self.fixed_offer, self.host, self.offers, self.lookups = server, offer, host, 0, 0

    async def call_protobuf_handler(self, peer_id, name, request, response_type):
        self.offers += 1
        return unary_response(self.fixed_offer or self.server.offer(CALLER_ID.to_base58()))

    async def list_peers(self):
        self.lookups += 1  # once per attempt to connect
        return [PeerInfo(SERVER_ID, [f"/ip4/{self.host}/tcp/4001", "/ip4/10.0.0.1/tcp/1/p2p/Qm/p2p-circuit"])]


async def echo(requests, context):
    """Answers with the caller's id, then each request's metadata and parts as they came."""
    yield runtime_pb2.ExpertResponse(metadata=context.remote_id.to_base58().encode())
    async for message in requests:
        if message.metadata == b"fail":
            raise ValueError("asked to fail")
        if message.metadata == b"slow":
            await asyncio.sleep(30)
        yield runtime_pb2.ExpertResponse(metadata=message.metadata, tensors=message.tensors)


async def never_reads(requests, context):
    """Takes nothing of the request for a long while (a handler stuck behind its compute)."""
    await asyncio.sleep(30)
    yield runtime_pb2.ExpertResponse(metadata=b"late")


async def refuse_early(requests, context):
    """Answers after the first message, as a refusal does, leaving the rest unread."""
    async for _ in requests:
        break
    yield runtime_pb2.ExpertResponse(metadata=b"refused")


def request(*metadata: bytes, part_bytes: int = 0):
    async def messages():
        for item in metadata:
            tensors = [runtime_pb2.Tensor(buffer=os.urandom(part_bytes), dtype="uint8", size=[part_bytes])]
            yield runtime_pb2.ExpertRequest(metadata=item, tensors=tensors if part_bytes else [])

    return messages()


async def started(**kwargs) -> DataPlaneServer:
    server = DataPlaneServer(local_id=SERVER_ID, limits=LIMITS, **kwargs)
    server.add_handler("echo", echo, runtime_pb2.ExpertRequest)
    server.add_handler("refuse", refuse_early, runtime_pb2.ExpertRequest)
    server.add_handler("never_reads", never_reads, runtime_pb2.ExpertRequest)
    await server.start(["127.0.0.1"])
    return server


async def call(client: DataPlaneClient, rpc: str, *metadata: bytes, part_bytes: int = 0) -> list:
    connection = await client.connection(SERVER_ID.to_base58())
    assert connection is not None
    answers = client.call(
        connection, rpc, request(*metadata, part_bytes=part_bytes), runtime_pb2.ExpertResponse, LIMITS
    )
    return [answer async for answer in answers]


def run(scenario):
    async def main():
        server = await started()
        control = ControlPlane(server)
        client = DataPlaneClient(control, connect_timeout_s=2.0, first_wait_s=10.0)
        client.control = control
        try:
            await scenario(server, client)
        finally:
            client.close()
            await server.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_call_arrives_whole_as_the_token_holder_and_its_connection_carries_the_next():
    async def scenario(server, client):
        answers = await call(client, "echo", b"a", b"b", part_bytes=3 << 20)
        assert answers[0].metadata == CALLER_ID.to_base58().encode()  # the caller, known by its token
        assert [a.metadata for a in answers[1:]] == [b"a", b"b"]
        assert all(len(a.tensors[0].buffer) == 3 << 20 and a.tensors[0].dtype == "uint8" for a in answers[1:])
        assert (await call(client, "echo", b"c"))[1].metadata == b"c"
        assert server.open_connections == 1 and client.control.offers == 1  # one connection, one offer
        stats = server.stats.snapshot()
        assert stats["calls"][("direct", "served", "echo")] == 2
        assert 2 * (3 << 20) < stats["bytes"][("direct", "received")] < 2 * (3 << 20) + 1024  # with the framing

    run(scenario)


def test_a_header_larger_than_the_read_buffer_and_many_small_messages_arrive_whole():
    async def scenario(server, client):
        big = os.urandom(60 << 10)  # a metadata near MAX_HEADER_BYTES: the read buffer grows for it
        answers = await call(client, "echo", big, *[str(i).encode() for i in range(200)], part_bytes=100)
        assert answers[1].metadata == big and [a.metadata for a in answers[2:]] == [str(i).encode() for i in range(200)]

    run(scenario)


def test_calls_at_once_each_get_a_connection_of_their_own():
    async def scenario(server, client):
        answers = await asyncio.gather(*(call(client, "echo", str(i).encode(), part_bytes=1 << 16) for i in range(6)))
        assert [a[1].metadata for a in answers] == [str(i).encode() for i in range(6)]
        assert server.open_connections == 6

    run(scenario)


def test_a_refusal_that_answers_early_leaves_the_connection_ready_for_the_next_call():
    async def scenario(server, client):
        answers = await call(client, "refuse", *[b"x"] * 8, part_bytes=1 << 20)
        assert [a.metadata for a in answers] == [b"refused"]
        assert (await call(client, "echo", b"next"))[1].metadata == b"next"
        assert server.open_connections == 1

    run(scenario)


def test_a_handler_that_fails_answers_an_error_and_an_unknown_rpc_too():
    async def scenario(server, client):
        with pytest.raises(P2PHandlerError, match="asked to fail"):
            await call(client, "echo", b"fail")
        with pytest.raises(P2PHandlerError, match="serves no 'nothing'"):
            await call(client, "nothing", b"x")

    run(scenario)


def test_a_handler_that_takes_nothing_holds_one_frame_and_the_sender_meets_its_write_deadline():
    async def scenario(server, client):
        started_at = time.monotonic()
        with pytest.raises(StreamDeadlineError):
            await call(client, "never_reads", *[b"m"] * 40, part_bytes=3 << 20)  # 120 MiB
        assert time.monotonic() - started_at < 2 * LIMITS.read_timeout_s + 2
        (connection,) = server._connections
        assert connection._queued <= MAX_QUEUED_BYTES + (3 << 20) + 1024  # reading paused: not 120 MiB

    run(scenario)


def test_a_frame_past_the_limit_closes_the_connection_before_its_body_is_read():
    async def scenario(server, client):
        with pytest.raises(ConnectionError):
            await call(client, "echo", b"big", part_bytes=LIMITS.max_message_bytes + 1)

    run(scenario)


def test_an_answer_that_does_not_come_is_a_deadline_and_a_dead_peer_a_broken_connection():
    async def scenario(server, client):
        started_at = time.monotonic()
        with pytest.raises(StreamDeadlineError):
            await call(client, "echo", b"slow")
        assert time.monotonic() - started_at < LIMITS.read_timeout_s + 2
        connection = await client.connection(SERVER_ID.to_base58())
        answers = client.call(connection, "echo", request(b"slow"), runtime_pb2.ExpertResponse, LIMITS)
        assert (await anext(answers)).metadata == CALLER_ID.to_base58().encode()
        await server.stop()  # the peer dies mid-call
        with pytest.raises(ConnectionResetError):
            await anext(answers)

    run(scenario)


def test_a_certificate_that_is_not_the_one_offered_gets_nothing_sent():
    async def scenario():
        server = await started()
        offer = server.offer(CALLER_ID.to_base58()).model_copy(update={"fingerprint": "0" * 64})
        control = ControlPlane(server, offer=offer)
        client = DataPlaneClient(control, connect_timeout_s=2.0, first_wait_s=10.0)
        try:
            assert await client.connection(SERVER_ID.to_base58()) is None
            assert control.offers == 2  # a fresh offer once, then p2pd until later
            assert client.reachable(SERVER_ID.to_base58()) is False
            assert await client.connection(SERVER_ID.to_base58()) is None and control.offers == 2
            assert server.stats.snapshot()["calls"] == {}
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_port_that_refuses_sends_calls_to_p2pd_and_is_tried_again_later_and_later():
    async def scenario():
        server = await started()
        offer = server.offer(CALLER_ID.to_base58()).model_copy(update={"port": 1})  # nothing listens there
        control = ControlPlane(server, offer=offer)
        client = DataPlaneClient(control, connect_timeout_s=2.0, retry_after_s=0.3, first_wait_s=10.0)
        peer = SERVER_ID.to_base58()
        try:
            assert await client.connection(peer) is None
            assert client.reachable(peer) is False and await client.connection(peer) is None
            await asyncio.sleep(0.35)
            assert control.lookups == 1 and control.offers == 1
            assert await client.connection(peer) is None and control.lookups == 2  # tried again, refused again
            assert control.offers == 2  # with a fresh offer
            await asyncio.sleep(0.35)  # ...and now not before 0.6 s
            assert await client.connection(peer) is None and control.lookups == 2
            await asyncio.sleep(0.3)
            control.fixed_offer = None  # the peer fixed its port map
            assert await client.connection(peer) is not None
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_unknown_token_is_refused_and_a_silent_connection_closed():
    async def scenario():
        server = await started(hello_timeout_s=1.0)
        offer = server.offer(CALLER_ID.to_base58()).model_copy(update={"token": "not-a-token-issued-here"})
        client = DataPlaneClient(ControlPlane(server, offer=offer), connect_timeout_s=2.0, first_wait_s=10.0)
        try:
            assert await client.connection(SERVER_ID.to_base58()) is None
            assert server.refused == 2
            # a TLS client that sends a call without a hello (refused), and one that says nothing (closed)
            for data, answer in ((call_frame("echo") + END_FRAME, REFUSED), (b"", None)):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=client_context())
                writer.write(data)
                started_at = time.monotonic()
                received = await asyncio.wait_for(reader.read(), 5)
                assert (received[0] if received else None) == answer
                assert time.monotonic() - started_at < 3.0
                writer.close()
            assert server.stats.snapshot()["calls"] == {} and server.open_connections == 0
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_caller_past_its_connection_cap_is_refused():
    async def scenario():
        server = await started(max_per_caller=2)
        client = DataPlaneClient(ControlPlane(server), connect_timeout_s=2.0, first_wait_s=10.0)
        try:
            held = [await client.connection(SERVER_ID.to_base58()) for _ in range(2)]
            assert all(held)
            assert await client.connection(SERVER_ID.to_base58()) is None
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_plain_tcp_client_gets_no_call_served():
    async def scenario():
        server = await started(hello_timeout_s=1.0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(hello_frame(server.offer(CALLER_ID.to_base58()).token) + call_frame("echo") + END_FRAME)
            assert await asyncio.wait_for(reader.read(), 15) == b""  # the TLS handshake fails: closed
            writer.close()
            assert server.stats.snapshot()["calls"] == {}
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_tokens_expire_are_shared_by_a_callers_connections_and_stay_bounded():
    now = [0.0]
    tokens = Tokens(ttl_s=100.0, max_tokens=3, clock=lambda: now[0])
    token, ttl = tokens.issue("a")
    assert tokens.caller(token) == "a" and ttl == 100.0
    now[0] = 40.0
    assert tokens.issue("a")[0] == token  # more than half its life left: the same token
    now[0] = 60.0
    renewed, _ = tokens.issue("a")
    assert renewed != token and tokens.caller(token) == "a"  # the old one still valid until it expires
    now[0] = 101.0
    assert tokens.caller(token) is None and tokens.caller(renewed) == "a"
    for caller in "bcd":
        tokens.issue(caller)
    assert tokens.caller(renewed) is None  # the oldest forgotten first
    assert tokens.caller(None) is None and tokens.caller("made up") is None


def test_only_direct_multiaddrs_name_a_host():
    assert direct_host("/ip4/192.168.1.2/tcp/31337/p2p/QmX") == "192.168.1.2"
    assert direct_host("/ip6/::1/udp/4001/quic") == "::1"
    assert direct_host("/ip4/1.2.3.4/tcp/1/p2p/QmR/p2p-circuit/p2p/QmX") is None
    assert direct_host("/dns4/example.org/tcp/1") is None


def test_the_server_speaks_tls_1_3_only():
    async def scenario():
        server = await started()
        try:
            old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            old.check_hostname, old.verify_mode = False, ssl.CERT_NONE
            old.maximum_version = ssl.TLSVersion.TLSv1_2
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.open_connection("127.0.0.1", server.port, ssl=old)
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
