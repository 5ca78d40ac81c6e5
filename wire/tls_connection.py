"""One data plane connection (wire/data_plane.py): TLS 1.3 with a per-process certificate, carrying
wire/frames.py's frames.

`Connection` is an asyncio buffered protocol: bytes are read straight into a buffer sized from each
frame's prefix (small frames and headers into one scratch buffer, a payload into its own), complete
frames queue for `read`, and reading pauses while more than MAX_QUEUED_BYTES wait. A frame past the
limits ends the connection at its prefix. Every `read` and `drain` has a deadline. What is written
in one turn of the event loop goes out in one TLS write and one system call. A framing error or the
connection's loss is raised by the `read` after the frames that arrived before it.

`make_certificate`, `server_context` and `client_context` make the TLS side: the client checks no
CA; it pins the certificate's SHA-256 fingerprint the peer told it over p2pd (wire/data_plane.py).
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import hashlib
import os
import ssl
import tempfile
from collections.abc import Callable, Sequence

from wire.bounded_streams import StreamDeadlineError
from wire.frames import PREFIX, FrameHeader, parse_header, parse_prefix
from wire.protocol import ProtocolError
from wire.transport_stats import TransportStats

SCRATCH_BYTES = 32 << 10  # prefixes, headers and small payloads; grown for a larger header
MAX_QUEUED_BYTES = 256 << 10  # frames read and not yet taken: past this, reading pauses (so a
# connection holds at most one frame of max_message_bytes beyond what its reader took)
WRITE_HIGH_BYTES, WRITE_LOW_BYTES = 4 << 20, 1 << 20
JOIN_BYTES = 64 << 10  # buffers smaller than this are joined before they are written (one TLS record)


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
        if self._reading_paused and self._queued <= MAX_QUEUED_BYTES and not self.closed:
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


def remote_host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if peer else "unknown"
