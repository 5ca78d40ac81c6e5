"""What a request may hold (issue #30): a stream message over the limit is refused from its length
prefix, before its body is read; every read has a deadline; the bytes requests hold in flight are
budgeted per caller and in all, and a request that trickles in is cut off at its deadline."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from wire.bounded_streams import (
    MessageTooLargeError,
    StreamDeadlineError,
    StreamLimits,
    receive_message,
    serve_bounded,
)
from wire.request_limits import InFlightBudgetError, InFlightBytes, RequestDeadlineError, RequestTooLargeError


def framed(message) -> bytes:
    data = message.SerializeToString()
    return P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


def end_of_stream() -> bytes:
    return P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


def read_all(data: bytes, limits: StreamLimits, *, close: bool = True) -> list:
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if close:
            reader.feed_eof()
        messages = []
        while (message := await receive_message(reader, runtime_pb2.ExpertRequest, limits)) is not None:
            messages.append(message)
        return messages

    return asyncio.run(run())


def test_messages_are_read_as_hivemind_frames_them():
    sent = [runtime_pb2.ExpertRequest(uid="a", metadata=b"x" * 100), runtime_pb2.ExpertRequest(uid="b")]
    data = b"".join(framed(m) for m in sent) + end_of_stream() + framed(runtime_pb2.ExpertRequest(uid="after"))
    assert read_all(data, StreamLimits()) == sent  # nothing is read past the end marker
    assert read_all(framed(sent[0]), StreamLimits()) == sent[:1]  # a stream that closes ends too


def test_a_message_over_the_limit_is_refused_from_its_prefix_alone():
    """Only the 9-byte prefix of a 512 MiB message arrives, and the stream stays open: the reader
    refuses at once, without waiting for (or buffering) the body."""
    prefix = P2P.MESSAGE_MARKER + (512 << 20).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    with pytest.raises(MessageTooLargeError, match="536870912 bytes"):
        read_all(prefix, StreamLimits(max_message_bytes=4 << 20, read_timeout_s=30.0), close=False)


def test_a_read_that_never_completes_hits_its_deadline():
    half = framed(runtime_pb2.ExpertRequest(metadata=b"x" * 1000))[:500]
    with pytest.raises(StreamDeadlineError):
        read_all(half, StreamLimits(read_timeout_s=0.2), close=False)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_in_flight_bytes_are_budgeted_per_caller_and_in_all():
    budget = InFlightBytes(per_caller_bytes=100, total_bytes=150, request_deadline_s=60, clock=Clock())
    a1, a2, b = budget.open("a"), budget.open("a"), budget.open("b")
    a1.take(60)
    a2.take(40)
    with pytest.raises(InFlightBudgetError, match="this caller"):
        a2.take(1)
    b.take(50)
    with pytest.raises(InFlightBudgetError, match="in flight"):
        b.take(1)  # b is within its own 100, but all requests hold 150
    assert (budget.held("a"), budget.held("b"), budget.total, budget.refused) == (100, 50, 150, 2)
    a1.close()
    b.take(40)
    assert (budget.held("a"), budget.total) == (40, 130)
    a2.close()
    b.close()
    assert budget.total == 0 and budget.held("a") == budget.held("b") == 0
    assert issubclass(InFlightBudgetError, RequestTooLargeError)  # refused as any request over a limit


def test_a_request_that_trickles_in_is_cut_off_at_its_deadline():
    clock = Clock()
    budget = InFlightBytes(per_caller_bytes=10**9, total_bytes=10**9, request_deadline_s=60, clock=clock)
    slow = budget.open("slow")
    for _ in range(59):  # one byte a second: each read is quick enough, the request is not
        clock.now += 1
        slow.take(1)
    clock.now += 2
    with pytest.raises(RequestDeadlineError):
        slow.take(1)
    slow.close()
    assert budget.total == 0


def test_budget_settings_are_checked():
    with pytest.raises(ValueError):
        InFlightBytes(per_caller_bytes=200, total_bytes=100, request_deadline_s=1)
    with pytest.raises(ValueError):
        InFlightBytes(per_caller_bytes=1, total_bytes=1, request_deadline_s=float("inf"))


def test_a_busy_peer_refuses_a_request_its_decoded_budget_cannot_hold_without_penalizing_the_caller():
    """Requests waiting for the compute thread hold their decoded tensors: past the peer's budget, the
    next request is answered 'internal' (busy: retry elsewhere), and the caller is not penalized."""
    import msgpack
    import torch

    from tests.unit.test_admission import FRIEND, call, registered_host
    from wire.messages import request_messages
    from wire.protocol import RPC_FORWARD, RequestHeader
    from wire.tensors import encode_tensor

    host, p2p = registered_host(max_request_mb=0.5, max_in_flight_mb=2.0, max_decoded_mb=1.0)
    budget = host.stage_rpc.decoded_budget
    waiting = budget.open("another-caller")
    waiting.take(budget.total_bytes - 1000)  # a request that waits for the compute thread
    inputs = encode_tensor(torch.zeros(2, 1000))  # 8000 bytes decoded
    header = RequestHeader(
        rpc="forward", model="tiny", stage=0, num_stages=2, microbatch_id="m", batch_size=2
    ).model_dump()
    header = RequestHeader.model_validate({**header, "tensors": {"inputs": inputs.header}})
    answer, _ = call(p2p, RPC_FORWARD, FRIEND, *request_messages(header, list(inputs.parts)))
    response = msgpack.unpackb(answer.metadata)
    assert response["error_kind"] == "internal" and "more bytes than this peer accepts" in response["error"]
    assert host.guard.penalties.limited() == [] and host.guard.penalties._bucket(FRIEND).tokens == 10
    assert budget.total == budget.total_bytes - 1000  # the refused request holds nothing
    waiting.close()


def fake_p2p() -> tuple[SimpleNamespace, dict]:
    """What `serve_bounded` needs of hivemind's P2P, and the handlers it registered by name; a test
    calls one as hivemind's ControlClient dispatches a stream: `handle(info, reader, writer)`."""
    registered = {}

    async def add_binary_stream_handler(name, handle):
        registered[name] = handle

    return SimpleNamespace(peer_id="me", add_binary_stream_handler=add_binary_stream_handler), registered


def test_a_handler_cut_off_by_the_loop_shutting_down_ends_its_stream_without_an_error_logged(tmp_path):
    """Ctrl-C on a demo once left a peer's log ending in an asyncio ERROR with a traceback: the
    handler of a stream whose caller had stopped reading was waiting to send when the event loop
    shut down and cancelled it, and Python 3.11's stream server callback, calling `task.exception()`
    on that cancelled task, raised (CPython gh-113538, fixed in 3.12). The handler treats the
    cancellation as the stream's end, as when the caller goes away."""
    p2p, registered = fake_p2p()

    async def endless_answers(request, context):
        while True:  # a caller that never reads fills the socket's buffers: the handler waits to send
            yield runtime_pb2.ExpertResponse(metadata=b"x" * (1 << 20))

    reported = []
    sending = asyncio.Event()

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        await serve_bounded(p2p, "rpc", endless_answers, runtime_pb2.ExpertRequest, StreamLimits(), stream_input=False)
        handle = registered["rpc"]

        async def connected(reader, writer):  # as hivemind's ControlClient._handler dispatches a stream
            sending.set()
            await handle(SimpleNamespace(peer_id="caller"), reader, writer)

        server = await asyncio.start_unix_server(connected, path=str(tmp_path / "p2p.sock"))
        _, writer = await asyncio.open_unix_connection(str(tmp_path / "p2p.sock"))
        writer.write(framed(runtime_pb2.ExpertRequest(uid="a")) + end_of_stream())
        await sending.wait()
        await asyncio.sleep(0.2)  # the handler is now blocked sending to a caller that does not read
        server.close()
        # returning leaves the handler to asyncio.run's shutdown, which cancels it

    asyncio.run(main())
    assert reported == []


def test_a_handler_ends_its_answer_with_the_marker_and_lets_the_caller_close_first(tmp_path):
    """A handler that closed its end right after answering could lose the answer's tail with no error
    (its p2pd resets the stream; benchmarks/stream_tail.py measured 3 answers in 2,400 a message
    short). It ends the answer with the end marker and closes only once the caller has closed (or
    after the read deadline); a caller that broke the limits is not waited for."""
    p2p, registered = fake_p2p()

    async def two_answers(requests, context):
        async for _ in requests:
            pass
        for uid in ("a", "b"):
            yield runtime_pb2.ExpertResponse(metadata=uid.encode())

    async def main():
        limits = StreamLimits(read_timeout_s=3.0)
        await serve_bounded(p2p, "rpc", two_answers, runtime_pb2.ExpertRequest, limits, stream_input=True)
        handled = []

        async def connected(reader, writer):
            task = asyncio.current_task()
            handled.append(task)
            await registered["rpc"](SimpleNamespace(peer_id="caller"), reader, writer)

        server = await asyncio.start_unix_server(connected, path=str(tmp_path / "p2p.sock"))
        async with server:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "p2p.sock"))
            writer.write(framed(runtime_pb2.ExpertRequest(uid="q")) + end_of_stream())
            answers = [await receive_message(reader, runtime_pb2.ExpertResponse, limits) for _ in range(3)]
            assert [a.metadata if a else None for a in answers] == [b"a", b"b", None]  # None: the marker
            await asyncio.sleep(0.3)
            assert not handled[0].done()  # the handler holds its end open for the caller to close first
            writer.close()
            await asyncio.wait_for(handled[0], timeout=5.0)  # and then ends at once

            # A caller that stalls mid-message gets its error and the stream closes at the deadline.
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "p2p.sock"))
            writer.write(framed(runtime_pb2.ExpertRequest(metadata=b"x" * 100))[:50])
            started = asyncio.get_running_loop().time()
            while await asyncio.wait_for(reader.read(1 << 16), timeout=15.0):
                pass
            closed_after = asyncio.get_running_loop().time() - started
            writer.close()
            assert closed_after < 5.5, closed_after  # one read deadline (3 s), not a second one for the close

    asyncio.run(main())
