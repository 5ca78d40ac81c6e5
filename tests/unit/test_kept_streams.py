"""A stream that carries one call after another (wire/bounded_streams.py): the handler serves the
next call on the stream it answered, the caller's `StreamPool` keeps a stream only when its call
ended cleanly, and either side gives an idle stream up. Both ends over real unix sockets, framed
as hivemind frames them; the handler dispatched as hivemind's ControlClient dispatches a stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from wire.bounded_streams import StreamLimits, StreamPool, call_on_streams, iterate_bounded, serve_bounded

PEER = SimpleNamespace(to_base58=lambda: "other")
LIMITS = StreamLimits(read_timeout_s=5.0, idle_timeout_s=5.0)


class Loopback:
    """What `serve_bounded` and `iterate_bounded` need of hivemind's P2P, over a unix socket:
    each stream the caller opens is a connection, handed to the registered handler."""

    def __init__(self, path: str):
        self.path, self.peer_id, self.handlers, self.opened, self.served = path, "me", {}, 0, []

    async def add_binary_stream_handler(self, name, handle):
        self.handlers[name] = handle

    async def start(self):
        async def connected(reader, writer):
            self.served.append(asyncio.current_task())
            await self.handlers["rpc"](SimpleNamespace(peer_id="caller"), reader, writer)

        return await asyncio.start_unix_server(connected, path=self.path)

    async def call_binary_stream_handler(self, peer_id, name):
        self.opened += 1
        reader, writer = await asyncio.open_unix_connection(self.path)
        return None, reader, writer


async def echo_calls(requests, context):
    """Answers each call with what it received, joined; 'fail' makes it raise."""
    received = []
    async for message in requests:
        received.append(message.uid)
        if message.uid == "early":  # answers before the rest of the request, as a refusal does
            break
    if "fail" in received:
        raise ValueError("asked to fail")
    if "slow" in received:
        await asyncio.sleep(10)
    yield runtime_pb2.ExpertResponse(metadata=",".join(received).encode())
    if "cut" in received:  # the stream closes after the first answer, without the end marker
        raise asyncio.CancelledError


async def call(p2p, pool, *uids: str) -> str:
    async def requests():
        for uid in uids:
            yield runtime_pb2.ExpertRequest(uid=uid)

    stream = await iterate_bounded(p2p, PEER, "rpc", requests(), runtime_pb2.ExpertResponse, LIMITS, pool=pool)
    return ",".join([answer.metadata.decode() async for answer in stream])


async def call_split(p2p, pool, *groups: tuple[str, ...], turn=None) -> list[str]:
    """One call on a stream per group of uids; each stream's answer."""
    calls = [("rpc", [runtime_pb2.ExpertRequest(uid=uid) for uid in group]) for group in groups]
    answers = await call_on_streams(p2p, PEER, calls, runtime_pb2.ExpertResponse, LIMITS, pool=pool, turn=turn)
    return [",".join(answer.metadata.decode() for answer in messages) for messages in answers]


def run(tmp_path, scenario, limits: StreamLimits = LIMITS):
    async def main():
        p2p = Loopback(str(tmp_path / "p2p.sock"))
        await serve_bounded(p2p, "rpc", echo_calls, runtime_pb2.ExpertRequest, limits, stream_input=True)
        server = await p2p.start()
        pool = StreamPool(max_idle_s=2.0)
        try:
            async with server:
                await scenario(p2p, pool)
        finally:
            pool.close()

    asyncio.run(main())


def test_calls_in_turn_share_one_stream_and_the_handler_serves_each_as_its_own_call(tmp_path):
    async def scenario(p2p, pool):
        assert await call(p2p, pool, "a", "b") == "a,b"
        assert await call(p2p, pool, "c") == "c"  # the second call's messages are its own
        assert await call(p2p, pool, "d", "e", "f") == "d,e,f"
        assert p2p.opened == 1 and pool.idle() == 1
        assert len(p2p.served) == 1 and not p2p.served[0].done()  # one handler task, waiting for a next call
        pool.close()  # the caller closes: the handler ends
        await asyncio.wait_for(p2p.served[0], timeout=5.0)

    run(tmp_path, scenario)


def test_calls_at_once_each_get_a_stream_and_give_them_back(tmp_path):
    async def scenario(p2p, pool):
        answers = await asyncio.gather(*(call(p2p, pool, str(i)) for i in range(3)))
        assert answers == ["0", "1", "2"] and p2p.opened == 3 and pool.idle() == 3
        await asyncio.gather(*(call(p2p, pool, str(i)) for i in range(3)))
        assert p2p.opened == 3

    run(tmp_path, scenario)


def test_a_call_answered_before_its_request_was_read_leaves_the_stream_ready_for_the_next(tmp_path):
    """A handler that answers early (a refusal) leaves the rest of the request unread: it is read and
    dropped up to the caller's end marker, and the next call on the stream is served at once."""

    async def scenario(p2p, pool):
        assert await call(p2p, pool, "early", "x", "y") == "early"
        assert await asyncio.wait_for(call(p2p, pool, "b"), timeout=2.0) == "b"
        assert p2p.opened == 1

    run(tmp_path, scenario)


def test_a_call_that_failed_does_not_give_its_stream_back(tmp_path):
    async def scenario(p2p, pool):
        assert await call(p2p, pool, "a") == "a"
        with pytest.raises(P2PHandlerError, match="asked to fail"):
            await call(p2p, pool, "fail")
        assert pool.idle() == 0  # the failed call's stream (the kept one) is closed
        assert await call(p2p, pool, "b") == "b" and p2p.opened == 2

    run(tmp_path, scenario)


def test_a_call_cut_off_by_its_timeout_does_not_give_its_stream_back(tmp_path):
    async def scenario(p2p, pool):
        assert await call(p2p, pool, "a") == "a"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call(p2p, pool, "slow"), timeout=0.5)
        assert pool.idle() == 0
        assert await call(p2p, pool, "b") == "b" and p2p.opened == 2

    run(tmp_path, scenario)


def test_an_idle_stream_is_given_up_by_the_handler_and_then_not_used(tmp_path):
    async def scenario(p2p, pool):
        pool.max_idle_s = 60.0  # the caller would keep it: the handler's idle timeout ends it first
        assert await call(p2p, pool, "a") == "a"
        await asyncio.wait_for(p2p.served[0], timeout=5.0)  # idle_timeout_s=0.5
        await asyncio.sleep(0.1)
        assert await call(p2p, pool, "b") == "b" and p2p.opened == 2  # the closed stream was not taken

    run(tmp_path, scenario, StreamLimits(read_timeout_s=5.0, idle_timeout_s=0.5))


def test_the_pool_drops_streams_idle_past_its_limit_and_over_its_size(tmp_path):
    async def scenario(p2p, pool):
        pool.max_per_peer = 2
        await asyncio.gather(*(call(p2p, pool, str(i)) for i in range(3)))
        assert pool.idle() == 2  # the third one back was closed
        pool.max_idle_s = 0.0
        assert await call(p2p, pool, "x") == "x" and p2p.opened == 4  # the idle ones expired

    run(tmp_path, scenario)


def test_a_handler_waiting_for_a_next_call_ends_quietly_when_the_peer_stops(tmp_path):
    """A kept stream's handler waits for the next call when the peer stops: the event loop's shutdown
    cancels it, and it ends its stream without asyncio logging an error (Python 3.11 logs one for
    a stream callback task that ends cancelled: see `serve_bounded`)."""
    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        p2p = Loopback(str(tmp_path / "p2p.sock"))
        await serve_bounded(p2p, "rpc", echo_calls, runtime_pb2.ExpertRequest, LIMITS, stream_input=True)
        server = await p2p.start()
        pool = StreamPool()
        assert await call(p2p, pool, "a") == "a" and pool.idle() == 1
        await asyncio.sleep(0.1)
        assert not p2p.served[0].done()  # waiting for the next call
        server.close()
        # returning leaves the handler to asyncio.run's shutdown, which cancels it

    asyncio.run(main())
    assert reported == []


def test_an_error_from_the_caller_between_calls_ends_the_stream_without_an_exception(tmp_path):
    async def scenario(p2p, pool):
        assert await call(p2p, pool, "a") == "a"
        _, _, writer = pool._idle[("other", "rpc")][-1]  # the kept stream, written to as a caller would
        error = RPCError(message="caller gave up").SerializeToString()
        writer.write(P2P.ERROR_MARKER + len(error).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + error)
        await asyncio.wait_for(p2p.served[0], timeout=5.0)
        assert p2p.served[0].exception() is None

    run(tmp_path, scenario)


def test_a_call_on_several_streams_gets_each_streams_answer_in_order_and_keeps_the_streams(tmp_path):
    async def scenario(p2p, pool):
        written = []

        class Turn:  # the link's turn: held while every stream is written
            async def __aenter__(self):
                written.append("taken")

            async def __aexit__(self, *exc):
                written.append("released")

        assert await call_split(p2p, pool, ("a", "b"), ("c",), ("d", "e"), turn=Turn()) == ["a,b", "c", "d,e"]
        assert written == ["taken", "released"] and p2p.opened == 3 and pool.idle() == 3
        assert await call_split(p2p, pool, ("f",), ("g",)) == ["f", "g"]
        assert p2p.opened == 3  # taken from the pool
        assert await call(p2p, pool, "h") == "h" and p2p.opened == 3

    run(tmp_path, scenario)


def test_a_call_on_several_streams_fails_when_one_stream_fails_and_keeps_none_of_them(tmp_path):
    async def scenario(p2p, pool):
        with pytest.raises(P2PHandlerError, match="asked to fail"):
            await call_split(p2p, pool, ("a",), ("fail",), ("b",))
        assert pool.idle() == 0
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call_split(p2p, pool, ("a",), ("slow",)), timeout=0.5)
        assert pool.idle() == 0
        with pytest.raises(ConnectionResetError, match=r"streams \[1\] of the call closed"):
            await call_split(p2p, pool, ("a",), ("cut",))  # a piece of the answer may be missing
        assert pool.idle() == 0
        assert await call_split(p2p, pool, ("c",), ("d",)) == ["c", "d"] and pool.idle() == 2

    run(tmp_path, scenario)
