"""The data plane: a peer's streamed RPCs over direct TLS 1.3 connections, with p2pd as the control plane.

p2pd carries every call through two Go daemons (a unix socket each side, yamux and noise): about 1
ms of CPU per call and 5-12 ms per MB summed over the processes of a hop (benchmarks/RESULTS.md,
"Transport cost"). Between two processes that reach each other directly, this carries the same
calls over one TLS connection (stdlib `ssl`, OpenSSL's AES-GCM), the same messages framed without
protobuf (wire/frames.py), read straight into buffers sized from each frame's prefix.

    server = DataPlaneServer(local_id=p2p.peer_id, limits=limits)
    server.add_handler(name, handler, request_type, stream_input=...)   as serve_bounded registers one
    await server.start(["127.0.0.1"], port)
    offer = server.offer(caller)             answered over p2pd (RPC_DATA_PLANE), so bound to the peer's identity
    client = DataPlaneClient(p2p)
    connection = await client.connection(peer_id)     None: not reachable now (nothing was sent)
    answers = client.call(connection, name, requests, response_type, limits)

Identity: a peer makes a TLS certificate per process and tells its SHA-256 fingerprint, its port and
a token for the caller over p2pd, whose connection authenticates both peer ids. The caller dials
that port at the host its p2pd connection to the peer comes from (never an address the peer names:
a peer cannot aim its callers at a third party), checks the certificate's fingerprint before it
sends anything, then sends the token (HELLO); the peer knows the caller by the token, which only
the two of them have seen. A token unknown, expired or of a caller with too many connections is
REFUSED and the connection closed.

Calls: one at a time on a connection, as on a kept p2pd stream (CALL, the request's messages, END;
the answer's messages, END or ERROR), with wire/bounded_streams.py's rules: every frame is refused
past `max_message_bytes` from its prefix, every read has a deadline, a refused request is read up
to its END so that the connection carries the next call, and a connection idle for `idle_timeout_s`
closes. A connection that breaks mid-call fails it (ConnectionResetError), as a broken stream does.
The caller keeps connections that ended a call cleanly (`max_idle_per_peer`, `max_idle_s`), so
calls in flight at once each have their own.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2

from wire.bounded_streams import StreamDeadlineError, StreamLimits
from wire.frames import (
    CALL,
    END,
    END_FRAME,
    ERROR,
    HELLO,
    MESSAGE,
    PREFIX,
    REFUSED,
    WELCOME,
    FrameHeader,
    call_frame,
    error_frame,
    frame,
    hello_frame,
    message_frame,
    parse_header,
    parse_prefix,
    to_message,
)
from wire.messages import read_unary, unary_request, unary_response
from wire.protocol import RPC_DATA_PLANE, DataPlaneOffer, DataPlaneRequest, ProtocolError

logger = logging.getLogger(__name__)

TRANSPORTS = ("direct", "p2pd")  # "direct": the data plane
SCRATCH_BYTES = 32 << 10  # prefixes, headers and small payloads; grown for a larger header
MAX_QUEUED_BYTES = 8 << 20  # frames read and not yet taken: past this, reading pauses
WRITE_HIGH_BYTES, WRITE_LOW_BYTES = 4 << 20, 1 << 20
JOIN_BYTES = 64 << 10  # buffers smaller than this are joined before they are written (one TLS record)


class DataPlaneRefusedError(ConnectionError):
    """The peer's data plane refused this caller's token."""


# --- identity ----------------------------------------------------------------------------------------


def make_certificate() -> tuple[bytes, bytes, str]:
    """A fresh self-signed TLS certificate (ECDSA P-256): its PEM, its key's PEM and the SHA-256
    fingerprint of its DER form (what a caller pins)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm data plane")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    der = certificate.public_bytes(serialization.Encoding.DER)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem, hashlib.sha256(der).hexdigest()


def server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory(prefix="swarm-tls-") as folder:  # ssl loads a key from files only
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert_path, cert_pem), (key_path, key_pem)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_path, key_path)
    return context


def client_context() -> ssl.SSLContext:
    """TLS 1.3 without a CA: the peer's certificate is pinned by its fingerprint instead (`connect`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


class Tokens:
    """The tokens a peer issued its callers over p2pd: token -> caller, each for `ttl_s` seconds,
    at most `max_tokens` (the oldest forgotten first). A caller keeps its token while it has more
    than half its lifetime left, so its connections share one."""

    def __init__(self, *, ttl_s: float = 3600.0, max_tokens: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_tokens, self._clock = ttl_s, max_tokens, clock
        self._callers: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._by_caller: dict[str, str] = {}

    def issue(self, caller: str) -> tuple[str, float]:
        """A token for `caller` and the seconds it stays valid."""
        now = self._clock()
        token = self._by_caller.get(caller)
        if token is not None and self._callers.get(token, ("", 0.0))[1] - now > self.ttl_s / 2:
            return token, self._callers[token][1] - now
        token = secrets.token_urlsafe(24)
        self._callers[token] = (caller, now + self.ttl_s)
        self._by_caller[caller] = token
        while len(self._callers) > self.max_tokens:
            old, (old_caller, _) = self._callers.popitem(last=False)
            if self._by_caller.get(old_caller) == old:
                del self._by_caller[old_caller]
        return token, self.ttl_s

    def caller(self, token: str | None) -> str | None:
        """Whose `token` this is, while it is valid."""
        entry = self._callers.get(token) if token else None
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]


# --- what crossed, per transport ---------------------------------------------------------------------


class TransportStats:
    """Calls and bytes per transport ("direct", "p2pd"): calls `made` and `served`, and the bytes
    `sent` and `received` as each transport frames them (a message's protobuf for p2pd; every frame
    on the data plane's connections, hellos included, TLS's own bytes not). Counted on the event
    loop, read from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: collections.Counter = collections.Counter()
        self._bytes: collections.Counter = collections.Counter()

    def call(self, transport: str, side: str) -> None:
        with self._lock:
            self._calls[transport, side] += 1

    def add_bytes(self, transport: str, direction: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[transport, direction] += nbytes

    def message(self, transport: str, direction: str, message: Any) -> None:
        """A protobuf message as p2pd carries it (its serialized size; no buffer is copied to count it)."""
        self.add_bytes(transport, direction, message.ByteSize())

    def snapshot(self) -> dict:
        """{"calls": {(transport, side): n}, "bytes": {(transport, direction): n}}"""
        with self._lock:
            return {"calls": dict(self._calls), "bytes": dict(self._bytes)}


# --- one connection ----------------------------------------------------------------------------------

Frame = tuple[int, FrameHeader, bytes | bytearray]


class Connection(asyncio.BufferedProtocol):
    """One TLS connection's frames. Reads go straight into buffers sized from each frame's prefix
    (small frames into one scratch buffer), complete frames queue for `read`; reading pauses while
    more than MAX_QUEUED_BYTES wait. A framing error or the connection's loss is raised by the
    `read` after the frames that arrived before it."""

    def __init__(
        self,
        max_payload_bytes: int,
        stats: TransportStats,
        on_made: Callable[[Connection], None] | None = None,
    ):
        self.max_payload_bytes, self.stats, self._on_made = max_payload_bytes, stats, on_made
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None  # the caller's peer id (server side), or the peer called (client side)
        self._scratch = bytearray(SCRATCH_BYTES)
        self._filled = 0  # bytes in the scratch buffer not yet parsed
        self._payload: bytearray | None = None  # a frame's payload being filled in place
        self._payload_at = 0
        self._pending: tuple[int, FrameHeader] | None = None  # that frame's kind and header
        self._frames: collections.deque[Frame] = collections.deque()
        self._queued = 0
        self._failure: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._write_paused, self._drained = False, None
        self._corked: list = []  # buffers written in this turn of the event loop, not yet handed on
        self._corked_bytes = 0
        self._reading_paused = False
        self.closed = False

    # --- asyncio's side ---
    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES, low=WRITE_LOW_BYTES)
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None:
            return memoryview(self._payload)[self._payload_at :]
        return memoryview(self._scratch)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.stats.add_bytes("direct", "received", nbytes)
        try:
            if self._payload is not None:
                self._payload_at += nbytes
                if self._payload_at < len(self._payload):
                    return
                self._complete(*self._pending, self._payload)
                self._payload, self._pending = None, None
            else:
                self._filled += nbytes
            self._parse()
        except ProtocolError as e:
            self._fail(e)

    def _parse(self) -> None:
        scratch, at = self._scratch, 0
        while self._filled - at >= PREFIX.size:
            kind, header_len, payload_len = parse_prefix(scratch[at : at + PREFIX.size], self.max_payload_bytes)
            start = at + PREFIX.size
            if self._filled - start < header_len:
                break
            header = parse_header(scratch[start : start + header_len], payload_len)
            start += header_len
            ready = min(payload_len, self._filled - start)
            if ready == payload_len:
                self._complete(kind, header, bytes(scratch[start : start + payload_len]))
                at = start + payload_len
                continue
            self._payload, self._payload_at, self._pending = bytearray(payload_len), ready, (kind, header)
            self._payload[:ready] = scratch[start : start + ready]
            at = self._filled
            break
        if at:
            left = self._filled - at
            scratch[:left] = scratch[at : self._filled]
            self._filled = left
        if self._payload is None and self._filled >= PREFIX.size:  # room for the whole header that comes
            _, header_len, _ = parse_prefix(scratch[: PREFIX.size], self.max_payload_bytes)
            if len(scratch) < PREFIX.size + header_len:  # a new one: asyncio may still hold a view of this one
                self._scratch = bytearray(PREFIX.size + header_len)
                self._scratch[: self._filled] = scratch[: self._filled]

    def _complete(self, kind: int, header: FrameHeader, payload: bytes | bytearray) -> None:
        self._frames.append((kind, header, payload))
        self._queued += len(payload) + PREFIX.size
        if self._queued > MAX_QUEUED_BYTES and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self._failure is None:
            self._failure = error
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._failure is None:
            self._failure = ConnectionResetError(f"the data plane connection closed{f': {exc}' if exc else ''}")
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # --- the caller's side ---
    async def read(self, timeout_s: float) -> Frame:
        """The next frame; StreamDeadlineError when none comes within `timeout_s`, the framing
        error or ConnectionResetError once the connection failed and its frames were read."""
        while not self._frames:
            if self._failure is not None:
                raise self._failure
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
            except TimeoutError:
                raise StreamDeadlineError(f"no data plane frame for {timeout_s:.0f} s") from None
            finally:
                self._waiter = None
        kind, header, payload = item = self._frames.popleft()
        self._queued -= len(payload) + PREFIX.size
        if self._reading_paused and self._queued < MAX_QUEUED_BYTES // 2 and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()
        return item

    def write(self, buffers: Sequence) -> None:
        """Queue `buffers`; what is queued in one turn of the event loop goes out in one write (a
        call's frames in one TLS record and one system call, not one per frame)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the data plane connection is closed")
        if not self._corked:
            self._corked = []
            asyncio.get_running_loop().call_soon(self._flush)
        nbytes = sum(len(buffer) for buffer in buffers)
        self._corked.extend(buffers)
        self._corked_bytes += nbytes
        self.stats.add_bytes("direct", "sent", nbytes)
        if self._corked_bytes >= WRITE_LOW_BYTES:
            self._flush()

    def _flush(self) -> None:
        corked, self._corked, self._corked_bytes = self._corked, [], 0
        if not corked or self.closed or self.transport is None or self.transport.is_closing():
            return
        joined, small = [], []
        for buffer in corked:
            if len(buffer) < JOIN_BYTES:
                small.append(buffer)
                continue
            if small:
                joined.append(b"".join(small))
                small = []
            joined.append(buffer)
        if small:
            joined.append(b"".join(small))
        self.transport.writelines(joined)

    async def drain(self, timeout_s: float) -> None:
        """Wait until what was written fits the write buffer again; StreamDeadlineError when the other
        side has not taken it within `timeout_s` (it stopped reading)."""
        if self._corked_bytes >= WRITE_LOW_BYTES:
            self._flush()
        while self._write_paused and not self.closed:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._drained
            except TimeoutError:
                raise StreamDeadlineError(f"the other side took nothing for {timeout_s:.0f} s") from None
        if self.closed:
            raise ConnectionResetError("the data plane connection closed")

    def close(self) -> None:
        """Close once what was written is sent."""
        if self.transport is not None and not self.closed:
            self._flush()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    @property
    def is_open(self) -> bool:
        return not self.closed and self._failure is None and self.transport is not None


def _remote_host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if peer else "unknown"


# --- the peer's side ---------------------------------------------------------------------------------

Handler = Callable[[Any, P2PContext], Any]


class DataPlaneServer:
    """A peer's listener: TLS connections from callers holding a token it issued, each carrying
    calls to the handlers registered here (the same guarded handlers it registers on p2pd).

    max_connections: open connections in all; max_per_caller: one caller's, once it said who it is;
    hello_timeout_s: how long a connection may take to say who it is (the TLS handshake included);
    announce_port: the port callers are told to dial, when a port map forwards it to the one listened
    on (0: the one listened on).
    """

    def __init__(
        self,
        *,
        local_id: PeerID,
        limits: StreamLimits,
        stats: TransportStats | None = None,
        max_connections: int = 1024,
        max_per_caller: int = 64,
        hello_timeout_s: float = 10.0,
        tokens: Tokens | None = None,
        announce_port: int = 0,
    ):
        self.local_id, self.limits, self.announce_port = local_id, limits, announce_port
        self.stats = stats or TransportStats()
        self.max_connections, self.max_per_caller, self.hello_timeout_s = (
            max_connections,
            max_per_caller,
            hello_timeout_s,
        )
        self.tokens = tokens or Tokens()
        cert_pem, key_pem, self.fingerprint = make_certificate()
        self._ssl = server_context(cert_pem, key_pem)
        self._handlers: dict[str, tuple[Handler, type, bool]] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._connections: set[Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._per_caller: collections.Counter = collections.Counter()
        self.port = 0
        self.refused = 0  # connections refused: unknown token, too many, no hello in time

    def add_handler(self, name: str, handler: Handler, request_type: type, *, stream_input: bool = True) -> None:
        """Serve `name` with `handler` as `wire.bounded_streams.serve_bounded` does: `(requests, context)`
        (an async iterator of request messages with `stream_input`, else the one request) -> answers."""
        self._handlers[name] = (handler, request_type, stream_input)

    async def start(self, hosts: Sequence[str], port: int = 0) -> int:
        """Listen on `port` (0: one the system picks, the same on every host) of each of `hosts`."""
        loop = asyncio.get_running_loop()
        for host in hosts:
            server = await loop.create_server(
                lambda: Connection(self.limits.max_message_bytes, self.stats, self._accepted),
                host,
                port or self.port,
                ssl=self._ssl,
                ssl_handshake_timeout=self.hello_timeout_s,
                reuse_address=True,
            )
            self._servers.append(server)
            self.port = self.port or server.sockets[0].getsockname()[1]
        return self.port

    def offer(self, caller: str) -> DataPlaneOffer:
        """What `caller` is told over p2pd (RPC_DATA_PLANE): the port, the fingerprint, its token."""
        if not self._servers:
            return DataPlaneOffer(error="this peer's data plane is not listening")
        token, ttl_s = self.tokens.issue(caller)
        return DataPlaneOffer(
            port=self.announce_port or self.port, fingerprint=self.fingerprint, token=token, expires_in_s=ttl_s
        )

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        self._servers.clear()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def _accepted(self, connection: Connection) -> None:
        if len(self._connections) >= self.max_connections:
            self.refused += 1
            connection.abort()
            return
        self._connections.add(connection)
        task = asyncio.ensure_future(self._serve_connection(connection))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_connection(self, connection: Connection) -> None:
        caller = None
        try:
            kind, header, _ = await connection.read(self.hello_timeout_s)
            caller = self.tokens.caller(header.token) if kind == HELLO else None
            if caller is None or self._per_caller[caller] >= self.max_per_caller:
                self.refused += 1
                why = "an unknown or expired token" if caller is None else "too many connections from this caller"
                logger.debug(f"data plane: refused a connection from {_remote_host(connection.transport)}: {why}")
                connection.write([error_frame(REFUSED, f"refused: {why}; ask for a new offer over p2pd")])
                caller = None
                return
            self._per_caller[caller] += 1
            connection.peer = caller
            connection.write([frame(WELCOME)])
            context = P2PContext(handle_name="", local_id=self.local_id, remote_id=PeerID.from_base58(caller))
            while True:
                kind, header, _ = await connection.read(self.limits.idle_timeout_s)
                if kind != CALL:
                    raise ProtocolError(f"expected a call, got a frame of kind {kind}")
                if not await self._serve_call(connection, header.rpc, context):
                    return
        except (ProtocolError, ConnectionError, ValueError, asyncio.CancelledError):
            return  # a deadline, a framing error, the caller gone, the server stopping: the connection ends
        finally:
            if caller is not None:
                self._per_caller[caller] -= 1
                if self._per_caller[caller] <= 0:
                    del self._per_caller[caller]
            self._connections.discard(connection)
            connection.close()

    async def _serve_call(self, connection: Connection, rpc: str | None, context: P2PContext) -> bool:
        """One call; True when the connection is free for another (the request read up to its END, answered)."""
        limits, stats = self.limits, self.stats
        entry = self._handlers.get(rpc or "")
        if entry is None:
            connection.write([error_frame(ERROR, f"this peer serves no {rpc!r} on its data plane")])
            return await self._skip_to_end(connection)
        handler, request_type, stream_input = entry
        stats.call("direct", "served")
        broke_limits, ends = [], []

        async def requests() -> AsyncIterator:
            try:
                while True:
                    try:
                        kind, header, payload = await connection.read(limits.read_timeout_s)
                    except ConnectionError:  # as a p2pd stream that closed: the request just ends
                        ends.append(False)
                        return
                    if kind == END:
                        ends.append(True)
                        return
                    if kind != MESSAGE:
                        raise ProtocolError(f"a request carries a frame of kind {kind}")
                    yield to_message(header, payload, request_type)
            except ProtocolError:
                broke_limits.append(True)
                raise

        try:
            if stream_input:
                answers = handler(requests(), context)
            else:
                messages = requests()
                request = await anext(messages, None)
                if request is None:
                    return False
                async for _ in messages:  # the END that follows at once
                    raise ProtocolError("a unary request carries more than one message")
                answers = handler(request, context)
            if not isinstance(answers, AsyncIterator):
                answers = _single(answers)
            async for answer in answers:
                connection.write(message_frame(answer))
                await connection.drain(limits.read_timeout_s)
            connection.write([END_FRAME])
            await connection.drain(limits.read_timeout_s)
            if broke_limits:
                return False
            return ends == [True] or await self._skip_to_end(connection)
        except (ConnectionError, asyncio.CancelledError):
            return False  # the caller went away, or the peer is stopping
        except Exception as e:
            logger.debug(f"{rpc} (data plane): {type(e).__name__}: {e}")
            with suppress(Exception):
                connection.write([error_frame(ERROR, str(e)[:1000])])
                await connection.drain(limits.read_timeout_s)
            if broke_limits or isinstance(e, ProtocolError):
                return False
            return ends == [True] or await self._skip_to_end(connection)

    async def _skip_to_end(self, connection: Connection) -> bool:
        """Read and drop the rest of a request up to its END (True), within `read_timeout_s` in all."""
        try:
            async with asyncio.timeout(self.limits.read_timeout_s):
                while (await connection.read(self.limits.read_timeout_s))[0] != END:
                    pass
            return True
        except (TimeoutError, ProtocolError, ConnectionError):
            return False


async def _single(answer) -> AsyncIterator:
    yield await answer


async def serve_offers(p2p: P2P, server: DataPlaneServer) -> None:
    """Answer RPC_DATA_PLANE on `p2p` with `server`'s offers, unguarded (a peer registers it behind
    its admission guard instead: peers/serving/host.py)."""

    async def offer(request, context) -> runtime_pb2.ExpertResponse:
        return unary_response(server.offer(context.remote_id.to_base58()))

    await p2p.add_protobuf_handler(RPC_DATA_PLANE, offer, runtime_pb2.ExpertRequest)


# --- the caller's side -------------------------------------------------------------------------------


class DataPlaneClient:
    """This process's connections to peers' data planes: one offer per peer (over p2pd, refreshed
    before its token expires), the connections kept between calls, and the peers it could not reach
    lately (tried again after `retry_after_s`, doubled on each failure in a row up to `max_retry_after_s`).

    A call waits for a new connection to a peer reached before, but at most `first_wait_s` for the
    first one to a peer not reached yet (a port that drops packets must not hold the call up: the
    call goes through p2pd, and the connection, once made, is kept for the next).
    connect_timeout_s: for the TLS connection and the peer's welcome, per host tried;
    offer_timeout_s: for the offer over p2pd; credential: this process's run credential, shown
    with the request for an offer (a private run's peer offers only to its credential holders).
    """

    def __init__(
        self,
        p2p: P2P,
        *,
        credential: str | None = None,
        stats: TransportStats | None = None,
        max_payload_bytes: int | None = None,
        connect_timeout_s: float = 5.0,
        first_wait_s: float = 1.0,
        offer_timeout_s: float = 10.0,
        retry_after_s: float = 60.0,
        max_retry_after_s: float = 1800.0,
        max_idle_per_peer: int = 16,
        max_idle_s: float = 10.0,
    ):
        self.p2p, self.credential = p2p, credential
        self.stats = stats or TransportStats()
        self.max_payload_bytes = max_payload_bytes or StreamLimits().max_message_bytes
        self.connect_timeout_s, self.first_wait_s, self.offer_timeout_s = (
            connect_timeout_s,
            first_wait_s,
            offer_timeout_s,
        )
        self.retry_after_s, self.max_retry_after_s = retry_after_s, max_retry_after_s
        self.max_idle_per_peer, self.max_idle_s = max_idle_per_peer, max_idle_s
        self._ssl = client_context()
        self._offers: dict[str, tuple[DataPlaneOffer, float]] = {}  # peer: (offer, refresh after, monotonic)
        self._unreachable: dict[str, tuple[float, int]] = {}  # peer: (until, monotonic; failures in a row)
        self._reached: set[str] = set()  # peers connected to before, and not unreachable since
        self._idle: dict[str, list[tuple[float, Connection]]] = {}
        self._offering: dict[str, asyncio.Future] = {}
        self._opening: set[asyncio.Task] = set()

    async def connection(self, peer_id: str) -> Connection | None:
        """An open connection to `peer_id`'s data plane (kept from an earlier call, or new), or None
        when it cannot be reached now: no offer, no host took the connection, or the first one is
        taking longer than `first_wait_s` (nothing was sent)."""
        kept = self._take(peer_id)
        if kept is not None:
            return kept
        if self._unreachable.get(peer_id, (0.0, 0))[0] > time.monotonic():
            return None
        opening = asyncio.ensure_future(self._open(peer_id))
        if peer_id in self._reached:
            return await opening
        done, _ = await asyncio.wait([opening], timeout=self.first_wait_s)
        if done:
            return opening.result()
        self._opening.add(opening)  # kept once it is made
        opening.add_done_callback(self._opened)
        return None

    async def reach(self, peer_id: str) -> bool:
        """Connect to `peer_id`'s data plane now, however long that takes (within the timeouts), and
        keep the connection for the next call; whether it could."""
        connection = await self.connection(peer_id) if self._idle.get(peer_id) else await self._open(peer_id)
        if connection is None:
            return False
        self.keep(connection)
        return True

    def _opened(self, task: asyncio.Task) -> None:
        """A first connection made in the background, after its call went through p2pd: kept."""
        if task in self._opening:
            self._opening.discard(task)
            if not task.cancelled() and task.exception() is None and task.result() is not None:
                self.keep(task.result())

    async def _open(self, peer_id: str) -> Connection | None:
        for fresh in (False, True):  # a refused token or a changed certificate: once more with a new offer
            offer = await self._offer(peer_id, fresh)
            if offer is None:
                break
            connection, retry = await self._connect(peer_id, offer)
            if connection is not None:
                self._reached.add(peer_id)
                self._unreachable.pop(peer_id, None)
                return connection
            if not retry:
                break
        self._reached.discard(peer_id)
        self._offers.pop(peer_id, None)  # the next try asks again: the peer may have moved or fixed its port map
        failures = self._unreachable.get(peer_id, (0.0, 0))[1] + 1
        wait_s = min(self.retry_after_s * 2 ** (failures - 1), self.max_retry_after_s)
        self._unreachable[peer_id] = (time.monotonic() + wait_s, failures)
        return None

    def reachable(self, peer_id: str) -> bool | None:
        """True: a connection to `peer_id` is kept; False: lately unreachable; None: not tried yet."""
        if self._idle.get(peer_id):
            return True
        return False if self._unreachable.get(peer_id, (0.0, 0))[0] > time.monotonic() else None

    def call(
        self, connection: Connection, name: str, requests: AsyncIterator, response_type: type, limits: StreamLimits
    ) -> AsyncIterator:
        """Call `name` on `connection`, as `wire.bounded_streams.iterate_bounded` does: the requests are
        sent while the answers are read (each within `limits`), up to the handler's END; the handler's
        ERROR raises P2PHandlerError, the connection breaking ConnectionResetError. A connection whose
        call ended cleanly is kept for the next."""
        stats = self.stats
        stats.call("direct", "made")

        async def send() -> None:
            connection.write([call_frame(name)])
            async for request in requests:
                connection.write(message_frame(request))
                await connection.drain(limits.read_timeout_s)
            connection.write([END_FRAME])
            await connection.drain(limits.read_timeout_s)

        async def answers() -> AsyncIterator:
            sending = asyncio.ensure_future(send())
            clean = False
            try:
                while True:
                    kind, header, payload = await connection.read(limits.read_timeout_s)
                    if kind == END:
                        break
                    if kind == ERROR:
                        raise P2PHandlerError(header.error or "the handler failed")
                    if kind != MESSAGE:
                        raise ProtocolError(f"an answer carries a frame of kind {kind}")
                    yield to_message(header, payload, response_type)
                with suppress(ConnectionError, OSError):  # the whole answer is here
                    await sending
                clean = sending.done() and not sending.cancelled() and sending.exception() is None
            finally:
                sending.cancel()
                if clean:
                    self.keep(connection)
                else:
                    connection.abort()

        return answers()

    def close(self) -> None:
        for task in list(self._opening):
            task.cancel()
        self._opening.clear()
        for connections in self._idle.values():
            for _, connection in connections:
                connection.close()
        self._idle.clear()

    # --- connections ---
    def _take(self, peer_id: str) -> Connection | None:
        connections = self._idle.get(peer_id)
        oldest = time.monotonic() - self.max_idle_s
        while connections:
            used, connection = connections.pop()
            if used >= oldest and connection.is_open:
                return connection
            connection.close()
        return None

    def keep(self, connection: Connection) -> None:
        """Keep an open connection for the next call to its peer (the oldest idle ones go first)."""
        if not connection.is_open:
            connection.abort()
            return
        connections = self._idle.setdefault(connection.peer, [])
        now = time.monotonic()
        while connections and (len(connections) >= self.max_idle_per_peer or connections[0][0] < now - self.max_idle_s):
            connections.pop(0)[1].close()
        connections.append((now, connection))

    async def _offer(self, peer_id: str, fresh: bool) -> DataPlaneOffer | None:
        held = self._offers.get(peer_id)
        if held is not None and not fresh and held[1] > time.monotonic():
            return held[0]
        if peer_id not in self._offering:  # one request per peer at a time; the others wait for it
            self._offering[peer_id] = asyncio.ensure_future(self._ask_offer(peer_id))
            self._offering[peer_id].add_done_callback(lambda _: self._offering.pop(peer_id, None))
        return await asyncio.shield(self._offering[peer_id])

    async def _ask_offer(self, peer_id: str) -> DataPlaneOffer | None:
        request = unary_request(DataPlaneRequest(credential=self.credential))
        try:
            reply = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(
                    PeerID.from_base58(peer_id), RPC_DATA_PLANE, request, runtime_pb2.ExpertResponse
                ),
                timeout=self.offer_timeout_s,
            )
            offer = read_unary(reply, DataPlaneOffer)
        except Exception as e:  # an older peer, a refusal, a timeout: p2pd it is
            logger.debug(f"no data plane offer from {peer_id[-8:]}: {type(e).__name__}: {e}")
            self._offers.pop(peer_id, None)
            return None
        if offer.error is not None or not offer.port or not offer.fingerprint or not offer.token:
            logger.debug(f"no data plane at {peer_id[-8:]}: {offer.error}")
            self._offers.pop(peer_id, None)
            return None
        self._offers[peer_id] = (offer, time.monotonic() + offer.expires_in_s / 2)
        return offer

    async def _hosts(self, peer_id: str) -> list[str]:
        """The hosts this process's p2pd connections to `peer_id` go to (direct ones, not relayed)."""
        hosts = []
        with suppress(Exception):
            for info in await asyncio.wait_for(self.p2p.list_peers(), timeout=self.offer_timeout_s):
                if info.peer_id.to_base58() != peer_id:
                    continue
                for maddr in info.addrs:
                    host = direct_host(str(maddr))
                    if host is not None and host not in hosts:
                        hosts.append(host)
        return hosts

    async def _connect(self, peer_id: str, offer: DataPlaneOffer) -> tuple[Connection | None, bool]:
        """A welcomed connection to the first of the peer's hosts that takes one; else None and
        whether a fresh offer may do better (the token refused, or another certificate)."""
        loop, retry = asyncio.get_running_loop(), False
        for host in await self._hosts(peer_id):
            connection = Connection(self.max_payload_bytes, self.stats)
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    transport, _ = await loop.create_connection(
                        lambda: connection,
                        host,
                        offer.port,
                        ssl=self._ssl,
                        ssl_handshake_timeout=self.connect_timeout_s,
                    )
                    certificate = transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
                    if not hmac.compare_digest(hashlib.sha256(certificate or b"").hexdigest(), offer.fingerprint):
                        retry = True
                        raise ssl.SSLError(
                            f"the certificate at {host}:{offer.port} is not the one {peer_id[-8:]} offered"
                        )
                    connection.write([hello_frame(offer.token)])
                    kind, header, _ = await connection.read(self.connect_timeout_s)
                    if kind == REFUSED:
                        retry = True
                        raise DataPlaneRefusedError(header.error or "refused")
                    if kind != WELCOME:
                        raise ProtocolError(f"expected a welcome, got a frame of kind {kind}")
                connection.peer = peer_id
                return connection, False
            except (OSError, TimeoutError, ProtocolError, ssl.SSLError) as e:
                logger.debug(f"data plane of {peer_id[-8:]} at {host}:{offer.port}: {type(e).__name__}: {e}")
                connection.abort()
        return None, retry


def direct_host(maddr: str) -> str | None:
    """The IP address of a direct multiaddr (/ip4/1.2.3.4/tcp/..., /ip6/...), None for a relayed one."""
    words = maddr.split("/")
    if "p2p-circuit" in words or len(words) < 3 or words[1] not in ("ip4", "ip6"):
        return None
    return words[2]
