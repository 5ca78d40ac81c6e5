"""Admission: the one check every RPC a peer serves passes before its handler runs.

`AdmissionGuard` wraps each handler the peer registers (peers/serving/host.py). A caller is refused,
before anything it sent is decoded, when
- the swarm is private (`--allowed-peers`) and the caller is not on the list (`NotAllowedError`);
- it sent too many bad requests lately (`RateLimitedError`, wire/request_limits.py's `PenaltyBox`);
- its request carries more tensor bytes than the RPC accepts (`RequestTooLargeError`);
- its requests in flight would exceed the budget, or a request arrives too slowly
  (`InFlightBudgetError`, `RequestDeadlineError`);
- the peer's run has an authority and the caller's credential does not allow what it asks
  (`NotAuthorizedError`, `POLICY`; handlers call `authorize` once they have read the header).
The same guarded handlers serve the peer's data plane (wire/data_plane.py). A refused caller of a
streamed RPC is read to the end before the answer, which is the RPC's own (each registration's
`refuse` function).

Details: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from dht.authority import ROLES, CredentialError, RunAuthority
from wire.bounded_streams import StreamLimits, serve_bounded
from wire.failures import Failure
from wire.protocol import ProtocolError
from wire.request_limits import (
    Hold,
    InFlightBudgetError,
    InFlightBytes,
    PenaltyBox,
    RequestDeadlineError,
    RequestTooLargeError,
    check_request_bytes,
)


class NotAllowedError(ProtocolError):
    """A private swarm's peer was called by a peer id not on its allowlist."""

    failure_kind = Failure.NOT_ALLOWED


class RateLimitedError(ProtocolError):
    """The caller sent too many bad requests lately (wire/request_limits.py)."""

    failure_kind = Failure.RATE_LIMITED


class NotAuthorizedError(NotAllowedError):
    """The caller holds no credential of the run's owner that allows what it asked."""


AdmissionError = NotAllowedError | RateLimitedError | RequestTooLargeError

# Who may do what in a run with an authority: the roles whose credential allows each action.
# "evaluate" (a forward that caches nothing), "connect" and the RPCs without a credential field need
# one only in a private run. Joining a stage's averaging needs a peer credential of that stage: hivemind's
# averager checks it itself (peers/replicas/averaging_members.py).
POLICY: dict[str, tuple[str, ...]] = {
    "train": ("trainer",),  # forward that caches for a backward, backward, commit
    "state": ROLES,  # download a stage's parameters and optimizer state (a peer: of its stage)
    "evaluate": ROLES,
    "chain": ("peer",),  # pass a trainer's chained call on to the next stage (direct routing)
    "connect": ROLES,  # be told how to reach the data plane (wire/data_plane.py); in a private run only
    "average": ("peer",),  # send a replica of its stage a pseudo-gradient (outer rounds)
}


def failure_kind(error: AdmissionError) -> str:
    """The metrics label of a refusal (peers/metrics.py `swarm_peer_request_failures_total`)."""
    return getattr(error, "failure_kind", Failure.TOO_LARGE).value


def caller_id(context: Any) -> str:
    """The base58 peer id of an RPC's caller (hivemind's P2PContext), or "unknown"."""
    remote = getattr(context, "remote_id", None)
    return remote.to_base58() if remote is not None else "unknown"


def _message_bytes(message: Any) -> int:
    return sum(len(part.buffer) for part in message.tensors)


@dataclasses.dataclass(frozen=True)
class Rpc:
    """One RPC as the peer registers it.

    handler: the service's handler, `(request or request stream, context)`.
    refuse: `(error, seconds spent on the request)` -> what the RPC answers a refused caller: a
        message, or an iterable of messages when `stream_output`.
    max_request_bytes: this RPC's size limit; None: the guard's (`--max-request-mb`).
    carries_credential: its request header has a `credential` the handler passes to `authorize`
        (or, as a chained call's piece, the call that takes it is authorized so); an RPC without
        one is served, in a private run, only to callers known to hold one.
    """

    name: str
    handler: Callable[..., Any]
    refuse: Callable[[AdmissionError, float], Any]
    stream_input: bool = False
    stream_output: bool = False
    max_request_bytes: int | None = None
    carries_credential: bool = False


class AdmissionGuard:
    def __init__(
        self,
        *,
        allowed_peers: Collection[str] = (),
        max_request_bytes: int,
        penalties: PenaltyBox,
        in_flight: InFlightBytes | None = None,
        stream_limits: StreamLimits | None = None,
        authority: RunAuthority | None = None,
    ):
        self.allowed_peers = frozenset(allowed_peers)
        self.max_request_bytes = max_request_bytes
        self.penalties = penalties
        self.in_flight = in_flight  # None: no budget of bytes in flight
        self.stream_limits = stream_limits  # None: hivemind's own stream reading (no bound per message)
        self.authority = authority
        self._credentialed: dict[str, float] = {}  # callers that presented a valid credential: until when

    # --- the decision ------------------------------------------------------------------------------
    def refusal(self, caller: str, *, needs_known_caller: bool = False) -> NotAllowedError | RateLimitedError | None:
        """Why `caller` may not be served now, or None. `needs_known_caller`: an RPC whose request
        carries no credential; in a private run, only callers that presented one before pass."""
        if self.allowed_peers and caller not in self.allowed_peers:
            return NotAllowedError(f"this is a private swarm and peer {caller} is not on its --allowed-peers")
        if needs_known_caller and self.authority is not None and self.authority.private:
            if self._credentialed.get(caller, 0.0) < time.time():
                return NotAuthorizedError(
                    f"run {self.authority.run.run_id} is private and peer {caller} has presented no credential for it"
                )
        if not self.penalties.allows(caller):
            return RateLimitedError(
                f"too many bad requests from {caller[-8:]}; refused for the next "
                f"{self.penalties.seconds_until_allowed(caller):.0f} s"
            )
        return None

    def authorize(self, caller: str, credential: str | None, action: str, *, stage: int | None = None) -> None:
        """Raise `NotAuthorizedError` unless `caller` may do `action` (a key of `POLICY`) on
        `stage`; without a run authority, or for an evaluation in an open run, anyone may."""
        authority = self.authority
        if authority is None or (action in ("evaluate", "connect") and not authority.private):
            return
        try:
            held = authority.verify(
                credential.encode() if credential else None, peer_id=caller, roles=POLICY[action], stage=stage
            )
        except CredentialError as e:
            raise NotAuthorizedError(f"not authorized: {e}") from None
        if len(self._credentialed) > 10_000:
            self._credentialed.clear()
        self._credentialed[caller] = held.expires_at

    def recognize(self, peer_ids: Collection[str], until: float) -> None:
        """These peers hold a credential (seen in their signed DHT records): in a private run, serve
        them the RPCs without a credential field until `until` (unix time)."""
        if len(self._credentialed) > 10_000:
            self._credentialed.clear()
        for peer_id in peer_ids:
            self._credentialed[peer_id] = max(self._credentialed.get(peer_id, 0.0), until)

    def penalize(self, caller: str) -> None:
        """`caller` sent a bad request (a handler's verdict after decoding it)."""
        self.penalties.penalize(caller)

    # --- wrapping handlers -------------------------------------------------------------------------
    def guarded(self, rpc: Rpc) -> Callable[..., Any]:
        """`rpc.handler` behind the guard, with the signature p2p's `add_protobuf_handler` expects."""
        limit = rpc.max_request_bytes if rpc.max_request_bytes is not None else self.max_request_bytes
        if rpc.stream_input:
            return self._guard_stream_input(rpc, limit)
        if rpc.stream_output:
            return self._guard_unary_input_stream_output(rpc, limit)
        return self._guard_unary(rpc, limit)

    async def register(self, p2p: Any, rpcs: Collection[Rpc], request_type: type, *, stats: Any = None) -> None:
        """Register every RPC of `rpcs` on `p2p`, each behind the guard (`stats`: wire/data_plane.py's
        TransportStats, counting the streamed calls)."""
        for rpc in rpcs:
            if self.stream_limits is not None and (rpc.stream_input or rpc.stream_output):
                await serve_bounded(
                    p2p,
                    rpc.name,
                    self.guarded(rpc),
                    request_type,
                    self.stream_limits,
                    stream_input=rpc.stream_input,
                    stats=stats,
                )
                continue
            await p2p.add_protobuf_handler(
                rpc.name,
                self.guarded(rpc),
                request_type,
                stream_input=rpc.stream_input,
                stream_output=rpc.stream_output,
            )

    def register_data_plane(self, server: Any, rpcs: Collection[Rpc], request_type: type) -> None:
        """Serve every streamed RPC of `rpcs` on the data plane `server` too, behind the same guard."""
        for rpc in rpcs:
            if rpc.stream_input or rpc.stream_output:
                server.add_handler(rpc.name, self.guarded(rpc), request_type, stream_input=rpc.stream_input)

    def _check_unary(self, rpc: Rpc, request: Any, caller: str, limit: int) -> AdmissionError | None:
        error = self.refusal(caller, needs_known_caller=not rpc.carries_credential)
        if error is None:
            try:
                check_request_bytes(_message_bytes(request), limit)
            except RequestTooLargeError as too_large:
                self.penalize(caller)
                return too_large
        return error

    def _guard_unary(self, rpc: Rpc, limit: int):
        async def guarded(request, context):
            started, caller = time.perf_counter(), caller_id(context)
            error = self._check_unary(rpc, request, caller, limit)
            if error is not None:
                return rpc.refuse(error, time.perf_counter() - started)
            return await rpc.handler(request, context)

        return guarded

    def _guard_unary_input_stream_output(self, rpc: Rpc, limit: int):
        async def guarded(request, context):
            started, caller = time.perf_counter(), caller_id(context)
            error = self._check_unary(rpc, request, caller, limit)
            if error is not None:
                for message in rpc.refuse(error, time.perf_counter() - started):
                    yield message
                return
            async for message in rpc.handler(request, context):
                yield message

        return guarded

    def _guard_stream_input(self, rpc: Rpc, limit: int):
        async def guarded(requests, context):
            started, caller = time.perf_counter(), caller_id(context)
            error = self.refusal(caller, needs_known_caller=not rpc.carries_credential)
            if error is not None:
                await drain(requests, limit)  # answering before the caller finished sending resets the stream
                for message in rpc.refuse(error, time.perf_counter() - started):
                    yield message
                return
            answered = False
            hold = self.in_flight.open(caller) if self.in_flight is not None else None
            try:
                async for message in rpc.handler(_size_limited(requests, limit, hold), context):
                    answered = True
                    yield message
            except RequestTooLargeError as too_large:  # a handler that does not answer this itself
                if answered:
                    raise
                if not isinstance(too_large, InFlightBudgetError):  # a busy peer is no offence of the caller
                    self.penalize(caller)
                for message in rpc.refuse(too_large, time.perf_counter() - started):
                    yield message
            finally:  # the request's bytes are dropped once it is answered
                if hold is not None:
                    hold.close()

        return guarded


async def _size_limited(requests: AsyncIterator, limit: int, hold: Hold | None = None) -> AsyncIterator:
    """The caller's messages while their tensors carry at most `limit` bytes in all and fit the
    in-flight budget (`hold`); past that, read the rest (up to `limit` more bytes, so that the caller
    gets the answer, not a reset) and raise `RequestTooLargeError` (or its subclass that says why)."""
    received = 0
    async for message in requests:
        nbytes = _message_bytes(message)
        received += nbytes
        try:
            check_request_bytes(received, limit)
            if hold is not None:
                hold.take(nbytes + len(message.metadata))
        except RequestDeadlineError:
            raise  # a caller that trickles gets no more time to drain
        except RequestTooLargeError:
            await drain(requests, limit)
            raise
        yield message


async def drain(requests: AsyncIterator, max_bytes: int) -> None:
    """Read (and drop, undecoded) what the caller sends, up to `max_bytes`."""
    received = 0
    async for message in requests:
        received += len(message.metadata) + _message_bytes(message)
        if received > max_bytes:
            return
