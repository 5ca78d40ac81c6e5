"""hivemind's protobuf streams, read with a size bound on every message and a deadline on every read.

hivemind's own stream handler (`P2P.add_protobuf_handler` with streams) reads each message whole,
whatever length its 8-byte prefix declares, before the handler sees it, and waits for the next one
forever: one 512 MiB message is buffered before any limit or allow list is checked, and a stream
that never finishes holds what it sent for good. The same framing is read here message by message,
on demand: a message whose prefix declares more than `max_message_bytes` is refused
(`MessageTooLargeError`) before its body is read, and a read that takes over `read_timeout_s`
ends the stream (`StreamDeadlineError`). Both are `ProtocolError`s, raised from the request
iterator into the handler, which answers them as it answers any bad request.

    serve_bounded(p2p, name, handler, request_type, limits, stream_input=...)   a peer's RPC
    await iterate_bounded(p2p, peer_id, name, requests, response_type, limits)  calling one

On the wire this is hivemind's framing (a marker byte, an 8-byte big-endian length, the protobuf),
with one addition: a handler ends its answers with hivemind's end marker (an empty error), as a
caller ends its requests, and then waits for the caller to close the stream before closing its
own side. A handler that closed first could lose the tail of its answer without any error: when
the handler's end of a libp2p stream closes, its p2pd resets the stream, and the caller's p2pd
drops what it had received but not yet handed to the caller (measured with two real daemons: 3 of
2,400 four-message answers came back a message short, `benchmarks/stream_tail.py`). The caller reads
up to the marker and closes first, so nothing is in flight when the handler closes. A plain hivemind
caller reads the marker as an error with an empty message; a caller of this module's earlier
versions (which read until the stream closed) reads it as the end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import closing, suppress
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto.p2pd_pb2 import RPCError

from wire.protocol import ProtocolError

logger = logging.getLogger(__name__)

# A stream message is a header and at most one 1 MiB tensor part (wire/messages.py); hivemind's
# unary calls stop at 2 MiB. Twice that leaves room for framing and a newer peer's extra fields.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


class MessageTooLargeError(ProtocolError):
    """A stream message declared more bytes than the receiver reads in one message."""


class StreamDeadlineError(ProtocolError):
    """The other side sent nothing for longer than the receiver waits."""


@dataclass(frozen=True)
class StreamLimits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    read_timeout_s: float = 30.0  # for each message, and for the caller's close after the answer (see above)


async def receive_message(reader: asyncio.StreamReader, message_type: type, limits: StreamLimits) -> Any | None:
    """The next message, or None at the end of the stream (the other side's end marker, or the
    connection closing). Raises MessageTooLargeError before reading a body over the limit,
    StreamDeadlineError when the message takes over `read_timeout_s`, ProtocolError on bad framing,
    and P2PHandlerError for an error the other side reported."""
    try:
        return await asyncio.wait_for(_receive(reader, message_type, limits.max_message_bytes), limits.read_timeout_s)
    except TimeoutError:
        raise StreamDeadlineError(f"no message for {limits.read_timeout_s:.0f} s") from None
    except asyncio.IncompleteReadError:
        return None


async def _receive(reader: asyncio.StreamReader, message_type: type, max_bytes: int):
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise ProtocolError(f"invalid stream message marker {marker!r}")
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        raise MessageTooLargeError(f"a stream message of {length} bytes exceeds the {max_bytes} this side reads")
    data = await reader.readexactly(length)
    if marker == P2P.ERROR_MARKER:
        error = RPCError()
        error.ParseFromString(data)
        if error.message:
            raise P2PHandlerError(error.message)
        return None  # hivemind's END_OF_STREAM: an empty error
    message = message_type()
    try:
        message.ParseFromString(data)
    except Exception:  # protobuf's DecodeError
        raise ProtocolError(f"a stream message is not a {message_type.__name__}") from None
    return message


async def _messages(reader: asyncio.StreamReader, message_type: type, limits: StreamLimits) -> AsyncIterator:
    while (message := await receive_message(reader, message_type, limits)) is not None:
        yield message


Handler = Callable[[Any, P2PContext], AsyncIterator | Awaitable]


async def serve_bounded(
    p2p: P2P,
    name: str,
    handler: Handler,
    request_type: type,
    limits: StreamLimits,
    *,
    stream_input: bool,
) -> None:
    """Register `handler` under `name` as hivemind's `add_protobuf_handler(..., stream_output=True)`
    does, reading the caller's messages within `limits`. With `stream_input`, the handler gets the
    messages as an async iterator (which raises the limits' errors); without, the first message
    (a stream that breaks a limit before it is answered with hivemind's error message)."""

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        broke_limits = []  # a caller that broke the limits is not waited for: its stream just closes

        async def requests() -> AsyncIterator:
            try:
                async for message in _messages(reader, request_type, limits):
                    yield message
            except ProtocolError:
                broke_limits.append(True)
                raise

        with closing(writer):
            try:
                if stream_input:
                    answers = handler(requests(), context)
                else:
                    request = await receive_message(reader, request_type, limits)
                    if request is None:
                        return
                    # The caller's end marker follows at once; read it, so its sending does not fail
                    # on a stream closed under it (a broken pipe instead of the answer).
                    await receive_message(reader, request_type, limits)
                    answers = handler(request, context)
                if not isinstance(answers, AsyncIterator):
                    answers = _single(answers)
                async for answer in answers:
                    await P2P.send_protobuf(answer, writer)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
                if not broke_limits:
                    await _until_caller_closes(reader, limits.read_timeout_s)
            except (ConnectionError, asyncio.IncompleteReadError):
                return  # the caller went away
            except asyncio.CancelledError:
                # Only the event loop's shutdown cancels this (the peer stopping while a caller's stream
                # is open, e.g. a handler waiting to send to a caller that stopped reading). The stream
                # just ends, as when the caller goes away. Not re-raised on purpose: this coroutine is
                # the whole task of hivemind's per-stream server callback (ControlClient._handler), and
                # under Python 3.11 that task ending cancelled makes asyncio log an ERROR with a
                # traceback (its done-callback calls `task.exception()`, which raises; CPython
                # gh-113538, fixed in 3.12): seen at the end of a demo's Ctrl-C.
                return
            except Exception as e:
                logger.debug(f"{name}: {type(e).__name__}: {e}")
                with suppress(Exception):
                    await P2P.send_protobuf(RPCError(message=str(e)[:1000]), writer)
                    if not broke_limits and not isinstance(e, ProtocolError):
                        await _until_caller_closes(reader, limits.read_timeout_s)

    await p2p.add_binary_stream_handler(name, handle)


async def _until_caller_closes(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) for the caller to close the stream, discarding whatever it still
    sends: the answer is then all delivered, and closing this side loses none of it."""
    with suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            while await reader.read(1 << 16):
                pass


async def _single(answer: Awaitable) -> AsyncIterator:
    yield await answer


async def iterate_bounded(
    p2p: P2P, peer_id: PeerID, name: str, requests: AsyncIterator, response_type: type, limits: StreamLimits
) -> AsyncIterator:
    """Call a streamed RPC as hivemind's `iterate_protobuf_handler` does; its answers are read
    within `limits` (a reply larger than the limit is refused before it is buffered), up to the
    handler's end marker (or the stream's end), and this side closes the stream first."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, name)

    async def send() -> None:
        async for request in requests:
            await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    async def answers() -> AsyncIterator:
        with closing(writer):
            sending = asyncio.create_task(send())
            try:
                async for answer in _messages(reader, response_type, limits):
                    yield answer
                with suppress(ConnectionError, OSError):  # the whole answer is here; a late end marker
                    await sending  # that found the stream closed does not matter
            finally:
                sending.cancel()

    return answers()
