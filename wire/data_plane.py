"""The data plane: a peer's streamed RPCs over direct TLS 1.3 connections, p2pd the control plane.

    server = DataPlaneServer(local_id=p2p.peer_id, limits=limits)
    server.add_handler(name, handler, request_type, stream_input=...)   as serve_bounded registers one
    await server.start(["127.0.0.1"], port)
    offer = server.offer(caller)          told over p2pd (RPC_DATA_PLANE): bound to the peer's identity
    connection = await DataPlaneClient(p2p).connection(peer_id)   None: not reachable now, nothing sent
    answers = client.call(connection, name, requests, response_type, limits)

Identity: a peer tells each caller over p2pd (whose connection authenticates both peer ids) its
TLS certificate's SHA-256 fingerprint, its port and a token for that caller. The caller dials that
port at the host its own p2pd connection to the peer comes from (never a host the peer names),
checks the fingerprint before it sends anything, then the token (HELLO); the peer knows the caller
by the token, which only the two of them have seen. An unknown or expired token, or a caller past
its connections, is REFUSED. Calls: one at a time on a connection (CALL, the request's messages,
END; the answer's, then END or ERROR), under wire/bounded_streams.py's rules (frames refused from
their prefix past the limit, a deadline on every read and write, a refused request read up to its
END, an idle connection closed); one that breaks mid-call fails it (ConnectionResetError). The
caller keeps connections that ended a call cleanly, so calls in flight at once each have their own.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2

from wire.bounded_streams import StreamLimits
from wire.frames import (
    CALL,
    END,
    END_FRAME,
    ERROR,
    HELLO,
    MESSAGE,
    REFUSED,
    WELCOME,
    call_frame,
    error_frame,
    frame,
    hello_frame,
    message_frame,
    to_message,
)
from wire.messages import read_unary, unary_request, unary_response
from wire.protocol import RPC_DATA_PLANE, DataPlaneOffer, DataPlaneRequest, ProtocolError
from wire.tls_connection import Connection, client_context, make_certificate, remote_host, server_context
from wire.transport_stats import TransportStats

logger = logging.getLogger(__name__)


class DataPlaneRefusedError(ConnectionError):
    """The peer's data plane refused this caller's token."""


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
        max_connections: int = 256,
        max_per_caller: int = 32,
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
                logger.debug(f"data plane: refused a connection from {remote_host(connection.transport)}: {why}")
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
        stats.call("direct", "served", rpc)
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
        stats.call("direct", "made", name)

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
