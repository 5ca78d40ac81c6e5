"""hivemind's protobuf streams, read with a size bound on every message and a deadline on every read.

hivemind's own stream handler reads each message whole, whatever length its prefix declares, and
waits for the next forever. Here the same framing is read message by message: a message whose
prefix declares more than `max_message_bytes` is refused before its body is read
(`MessageTooLargeError`), and a read that takes over `read_timeout_s` ends the stream
(`StreamDeadlineError`); both are `ProtocolError`s.

    serve_bounded(p2p, name, handler, request_type, limits, stream_input=...)   a peer's RPC
    await iterate_bounded(p2p, peer_id, name, requests, response_type, limits)  calling one
    await iterate_bounded(..., pool=StreamPool())                               on a kept stream
    await call_on_streams(p2p, peer_id, [(name, messages), ...], ...)          one call on several

On the wire: hivemind's framing, plus an end marker after a handler's answers; the caller reads up
to it and closes first, so no answer loses its tail. A stream carries one call after another
(`idle_timeout_s`), and `StreamPool` keeps streams that ended a call cleanly for the next call to
the same peer and RPC. `call_on_streams` sends one call's pieces on streams of their own.

Why, with the measurements: docs/design/wire.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, closing, nullcontext, suppress
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto.p2pd_pb2 import RPCError

from wire.protocol import ProtocolError

logger = logging.getLogger(__name__)

# A stream message is a header and at most 1 MiB of tensor parts (wire/messages.py); hivemind's
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
    idle_timeout_s: float = 30.0  # after an answer, for the caller's next call on the same stream


async def receive_message(reader: asyncio.StreamReader, message_type: type, limits: StreamLimits) -> Any | None:
    """The next message, or None at the end of the stream (the other side's end marker, or the
    connection closing). Raises MessageTooLargeError before reading a body over the limit,
    StreamDeadlineError when the message takes over `read_timeout_s`, ProtocolError on bad framing,
    and P2PHandlerError for an error the other side reported."""
    message = await _next(reader, message_type, limits)
    return None if message is _CLOSED else message


_CLOSED = object()  # what `_next` returns when the stream closed (None: the other side's end marker)


async def _next(reader: asyncio.StreamReader, message_type: type, limits: StreamLimits, timeout_s: float | None = None):
    timeout_s = limits.read_timeout_s if timeout_s is None else timeout_s
    try:
        return await asyncio.wait_for(_receive(reader, message_type, limits.max_message_bytes), timeout_s)
    except TimeoutError:
        raise StreamDeadlineError(f"no message for {timeout_s:.0f} s") from None
    except asyncio.IncompleteReadError:
        return _CLOSED


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


async def _messages(
    reader: asyncio.StreamReader, message_type: type, limits: StreamLimits, ends: list | None = None
) -> AsyncIterator:
    """The messages up to the end marker or the stream's close; `ends` gets True when it was the marker."""
    while True:
        message = await _next(reader, message_type, limits)
        if message is None or message is _CLOSED:
            if ends is not None:
                ends.append(message is None)
            return
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
    stats: Any = None,
) -> None:
    """Register `handler` under `name` as hivemind's `add_protobuf_handler(..., stream_output=True)`
    does, reading the caller's messages within `limits`. With `stream_input`, the handler gets the
    messages as an async iterator (which raises the limits' errors); without, the first message
    (a stream that breaks a limit before it is answered with hivemind's error message). `stats`
    (wire/data_plane.py's TransportStats) counts the calls served and their messages' bytes."""

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        with closing(writer):
            first = None  # a later call's first message, read while waiting for it
            while await serve_call(context, reader, writer, first):
                try:  # the stream is free for the caller's next call, or its close
                    first = await _next(reader, request_type, limits, limits.idle_timeout_s)
                except (ProtocolError, P2PHandlerError, ConnectionError, asyncio.CancelledError):  # see serve_call
                    return
                if first is None or first is _CLOSED:
                    return

    async def serve_call(context, reader, writer, first) -> bool:
        """One call on the stream; True when the stream is free for another (the whole request was
        read up to its end marker, and answered)."""
        broke_limits = []  # a caller that broke the limits is not waited for: its stream just closes
        ends = []  # True once the request was read up to the caller's end marker

        async def requests() -> AsyncIterator:
            try:
                if first is not None:
                    yield _counted(first, "received")
                async for message in _messages(reader, request_type, limits, ends):
                    yield _counted(message, "received")
            except ProtocolError:
                broke_limits.append(True)
                raise

        if stats is not None:
            stats.call("p2pd", "served", name)
        try:
            if stream_input:
                answers = handler(requests(), context)
            else:
                request = first if first is not None else await receive_message(reader, request_type, limits)
                if request is None:
                    return False
                _counted(request, "received")
                # The caller's end marker follows at once; read it, so its sending does not fail
                # on a stream closed under it (a broken pipe instead of the answer).
                marker = await _next(reader, request_type, limits)
                ends.append(marker is None)
                answers = handler(request, context)
            if not isinstance(answers, AsyncIterator):
                answers = _single(answers)
            async for answer in answers:
                await P2P.send_protobuf(_counted(answer, "sent"), writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            if broke_limits:
                return False
            # A handler that answered before reading the whole request (a refusal): the rest is read
            # and dropped up to the caller's end marker, so that the stream can carry the next call.
            return ends == [True] or await _skip_to_end(reader, request_type, limits)
        except (ConnectionError, asyncio.IncompleteReadError):
            return False  # the caller went away
        except asyncio.CancelledError:
            # Only the event loop's shutdown cancels this (the peer stopping while a caller's stream
            # is open, e.g. a handler waiting to send to a caller that stopped reading). The stream
            # just ends, as when the caller goes away. Not re-raised on purpose: this coroutine is
            # the whole task of hivemind's per-stream server callback (ControlClient._handler), and
            # under Python 3.11 that task ending cancelled makes asyncio log an ERROR with a
            # traceback (its done-callback calls `task.exception()`, which raises; CPython
            # gh-113538, fixed in 3.12): seen at the end of a demo's Ctrl-C.
            return False
        except Exception as e:
            logger.debug(f"{name}: {type(e).__name__}: {e}")
            with suppress(Exception):
                await P2P.send_protobuf(RPCError(message=str(e)[:1000]), writer)
                if not broke_limits and not isinstance(e, ProtocolError):
                    await _until_caller_closes(reader, limits.read_timeout_s)
        return False

    def _counted(message, direction: str):
        if stats is not None:
            stats.message("p2pd", direction, message)
        return message

    await p2p.add_binary_stream_handler(name, handle)


async def _skip_to_end(reader: asyncio.StreamReader, message_type: type, limits: StreamLimits) -> bool:
    """Read and drop the caller's messages up to its end marker (True), within `read_timeout_s` in
    all; False when the stream closed, broke the limits or took longer."""
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            while (message := await _next(reader, message_type, limits)) is not None:
                if message is _CLOSED:
                    return False
            return True
    except (TimeoutError, ProtocolError, P2PHandlerError, ConnectionError):
        return False


async def _until_caller_closes(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) for the caller to close the stream, discarding whatever it still
    sends: the answer is then all delivered, and closing this side loses none of it."""
    with suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            while await reader.read(1 << 16):
                pass


async def _single(answer: Awaitable) -> AsyncIterator:
    yield await answer


async def _open_stream(
    p2p: P2P, peer_id: PeerID, name: str, pool: StreamPool | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to `peer_id`'s RPC `name`: one `pool` kept, or a new one."""
    kept = pool.take((peer_id.to_base58(), name)) if pool is not None else None
    return kept if kept is not None else (await p2p.call_binary_stream_handler(peer_id, name))[1:]


async def iterate_bounded(
    p2p: P2P,
    peer_id: PeerID,
    name: str,
    requests: AsyncIterator,
    response_type: type,
    limits: StreamLimits,
    *,
    pool: StreamPool | None = None,
) -> AsyncIterator:
    """Call a streamed RPC as hivemind's `iterate_protobuf_handler` does; its answers are read
    within `limits` (a reply larger than the limit is refused before it is buffered), up to the
    handler's end marker (or the stream's end), and this side closes the stream first. With `pool`,
    the call goes on a stream the pool kept from an earlier call to the same peer and RPC, if it has
    one, and a stream whose call ended cleanly goes back to the pool instead of closing."""
    key = (peer_id.to_base58(), name)
    reader, writer = await _open_stream(p2p, peer_id, name, pool)

    async def send() -> None:
        async for request in requests:
            await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    async def answers() -> AsyncIterator:
        sending = asyncio.create_task(send())
        ends, kept_open = [], False
        try:
            async for answer in _messages(reader, response_type, limits, ends):
                yield answer
            with suppress(ConnectionError, OSError):  # the whole answer is here; a late end marker
                await sending  # that found the stream closed does not matter
            if (
                pool is not None
                and ends == [True]
                and sending.done()
                and not sending.cancelled()
                and sending.exception() is None
            ):
                kept_open = pool.keep(key, reader, writer)
        finally:
            sending.cancel()
            if not kept_open:
                writer.close()

    return answers()


async def call_on_streams(
    p2p: P2P,
    peer_id: PeerID,
    calls: Sequence[tuple[str, Sequence[Any]]],
    response_type: type,
    limits: StreamLimits,
    *,
    pool: StreamPool | None = None,
    turn: AbstractAsyncContextManager | None = None,
) -> list[list[Any]]:
    """One call whose request crosses on several streams (`calls`: each stream's RPC and its
    messages), and the answer messages each stream brought back, in the same order. The streams
    are opened (or taken from `pool`) together, then written one after the other within `turn`
    (the link's turn: held while the request is written, not while the answers come); each answer
    is read within `limits` up to its end marker. Any stream failing fails the call (one that
    closed before its end marker: ConnectionResetError), and every stream of it is closed; with
    `pool`, the streams of a call that ended cleanly are kept."""
    name = peer_id.to_base58()
    opening = [asyncio.ensure_future(_open_stream(p2p, peer_id, rpc, pool)) for rpc, _ in calls]
    streams, kept = [], []
    try:
        streams = await asyncio.gather(*opening)
        async with turn if turn is not None else nullcontext():
            for (_, writer), (_, messages) in zip(streams, calls, strict=True):
                for message in messages:
                    await P2P.send_protobuf(message, writer)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

        async def answer(reader: asyncio.StreamReader) -> tuple[list, bool]:
            ends: list[bool] = []
            messages = [message async for message in _messages(reader, response_type, limits, ends)]
            return messages, ends == [True]

        answers = await asyncio.gather(*(answer(reader) for reader, _ in streams))
        broken = [index for index, (_, clean) in enumerate(answers) if not clean]
        if broken:  # part of the answer may be missing: the call failed in transit
            raise ConnectionResetError(f"streams {broken} of the call closed before their answers ended")
        if pool is not None:
            for (rpc, _), (reader, writer) in zip(calls, streams, strict=True):
                if pool.keep((name, rpc), reader, writer):
                    kept.append(writer)
        return [messages for messages, _ in answers]
    finally:
        for future in opening:
            if not future.done():
                future.cancel()
            elif not future.cancelled() and future.exception() is None and future.result()[1] not in kept:
                future.result()[1].close()


class StreamPool:
    """The caller's streams kept open between calls (see the module's docstring): per peer and RPC,
    at most `max_per_peer` idle ones, each for at most `max_idle_s` (below the handler's
    `idle_timeout_s`, so a stream is not taken just as the other side gives up on it). One call at a
    time on a stream: a call takes one, and only a call that ended cleanly (the whole request sent,
    the whole answer read up to the end marker) gives it back."""

    def __init__(self, *, max_per_peer: int = 16, max_idle_s: float = 10.0):
        self.max_per_peer, self.max_idle_s = max_per_peer, max_idle_s
        self._idle: dict[tuple[str, str], list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    def take(self, key: tuple[str, str]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used idle stream for `key` (peer, RPC) that is still open, or None."""
        self._expire()
        streams = self._idle.get(key, [])
        while streams:
            _, reader, writer = streams.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    def keep(self, key: tuple[str, str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Keep a stream whose call ended cleanly; False (the caller closes it) when it is not kept."""
        if reader.at_eof() or writer.is_closing():
            return False
        streams = self._idle.setdefault(key, [])
        streams.append((time.monotonic(), reader, writer))
        while len(streams) > self.max_per_peer:
            streams.pop(0)[2].close()
        return True

    def idle(self, key: tuple[str, str] | None = None) -> int:
        """How many streams are kept (for `key`, or in all)."""
        return sum(len(v) for k, v in self._idle.items() if key is None or k == key)

    def close(self) -> None:
        for streams in self._idle.values():
            for _, _, writer in streams:
                writer.close()
        self._idle.clear()

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_idle_s
        for key in list(self._idle):
            streams = self._idle[key]
            while streams and streams[0][0] < oldest:
                streams.pop(0)[2].close()
            if not streams:
                del self._idle[key]
