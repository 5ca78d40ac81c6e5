"""Can others reach this node directly? A dial-back check, and advice a volunteer can act on.

hivemind 1.1.12 has no reachability check of its own (AutoNAT runs inside p2pd and its verdict
is not exposed), so peers help each other: a peer serves `RPC_REACHABILITY`; asked by a caller
for its own peer id and multiaddrs, it starts a short-lived probe daemon (its own identity, relays
off, so it cannot reuse an existing connection or go through a relay), dials those of the addresses
that are on the caller's own host and answers whether the handshake succeeded, with one error text
for every failure, rate-limited per caller and in total. A starting peer asks a few online peers and prints the verdict.

The pure parts (`direct_maddrs`, `dial_back_targets`, `address_scope`, `verdict`) hold every decision.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wire.request_limits import PenaltyBox

logger = logging.getLogger(__name__)

RPC_REACHABILITY = "swarm.reachability_check"
MAX_MADDRS = 16


class ReachabilityRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)
    peer_id: str = Field(min_length=1, max_length=128)
    maddrs: tuple[str, ...] = Field(max_length=MAX_MADDRS)


class ReachabilityResponse(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)
    reachable: bool
    error: str | None = Field(default=None, max_length=500)


# --- pure ----------------------------------------------------------------------------------------


def direct_maddrs(maddrs: Iterable[str]) -> list[str]:
    """Addresses a probe can dial directly: no relay circuits, no trailing /p2p/<id>."""
    result = []
    for maddr in maddrs:
        text = str(maddr)
        if "/p2p-circuit" in text:
            continue
        text = text.split("/p2p/")[0]
        if text and text not in result:
            result.append(text)
    return sorted(result)


def address_scope(maddr: str) -> str:
    """ "loopback", "private" (LAN, link-local, CGNAT) or "public" for an /ip4 or /ip6 address;
    "name" for /dns*."""
    parts = str(maddr).split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return "name"
    try:
        address = ipaddress.ip_address(parts[2])
    except ValueError:
        return "name"
    if address.is_loopback:
        return "loopback"
    if address.is_private or address.is_link_local or address in ipaddress.ip_network("100.64.0.0/10"):
        return "private"
    return "public"


@dataclass(frozen=True)
class ReachabilityReport:
    maddrs: tuple[str, ...]  # what was tested
    asked: int  # peers that answered
    reachable_by: int
    errors: tuple[str, ...] = ()

    @property
    def reachable(self) -> bool | None:
        """True/False once someone answered; None when nobody could be asked."""
        return None if self.asked == 0 else self.reachable_by > 0


def verdict(report: ReachabilityReport, *, use_auto_relay: bool) -> str:
    """One line for the start-up log: whether others can reach this peer, and what to do if not."""
    scopes = {address_scope(m) for m in report.maddrs}
    where = ", ".join(report.maddrs) or "no address"
    if not report.maddrs:
        return "reachability: this peer has no direct address to offer; others can reach it only through a relay" + (
            "" if use_auto_relay else " (start with --use-auto-relay)"
        )
    if report.reachable is None:
        scope_note = {
            frozenset({"loopback"}): "it listens on loopback only, so only processes on this machine can reach it "
            "(use --host-maddrs /ip4/0.0.0.0/tcp/PORT to accept other machines)",
        }.get(
            frozenset(scopes),
            ""
            if "public" in scopes
            else "it has no public address: machines outside this network need a port forward and --announce-maddrs "
            "/ip4/PUBLIC_IP/tcp/PORT, or --use-auto-relay",
        )
        if scopes == {"loopback"}:
            return f"reachability: not checked: {scope_note} ({where})"
        return (
            f"reachability: no other peer online to check with yet ({where}){'; ' + scope_note if scope_note else ''}"
        )
    if report.reachable:
        note = " (loopback only: this machine's processes)" if scopes == {"loopback"} else ""
        return (
            f"reachability: {report.reachable_by}/{report.asked} peer(s) could dial this peer directly at {where}{note}"
        )
    fix = (
        "--use-auto-relay is on, so it may still be reached through a relay once one is found"
        if use_auto_relay
        else "start with --use-auto-relay to be reached through a relay"
    )
    return (
        f"reachability: NOT reachable: 0/{report.asked} peer(s) could dial this peer at {where}; trainers and "
        f"other peers will fail to call it. Open or forward the TCP port and pass --announce-maddrs "
        f"/ip4/PUBLIC_IP/tcp/PORT, or {fix}"
    )


# --- serving the check ---------------------------------------------------------------------------

DIAL_BACK_FAILED = "could not dial this caller back at its own address"
"""The one answer for every failed or refused check: a helper that told a refused address, a
closed port, a timeout and a failed handshake apart would be a port scanner for anyone (issue #30)."""


def dial_back_targets(requested: Iterable[str], caller_hosts: Iterable[str]) -> list[str]:
    """The requested direct addresses a helper may dial: only those on a host the caller's own
    connection comes from, so a caller can make a helper dial nothing but itself."""
    hosts = set(caller_hosts)
    return [m for m in direct_maddrs(requested) if _host_of(m) in hosts]


def _host_of(maddr: str) -> str | None:
    parts = str(maddr).split("/")
    return parts[2] if len(parts) >= 3 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") else None


class DialBackService:
    """The `RPC_REACHABILITY` handler. It dials back only the caller itself: the caller's own peer id
    (the handshake checks it), at addresses on the host its connection comes from; at most one
    probe at a time, `per_caller` checks per caller in a burst and `in_total` from all callers
    (token buckets, refilled every `refill_s` seconds); every failure gets the same answer."""

    def __init__(
        self, *, dial_timeout_s: float = 10.0, per_caller: int = 2, in_total: int = 10, refill_s: float = 60.0
    ):
        self.dial_timeout_s = dial_timeout_s
        self.p2p: P2P | None = None  # set by `register`, or by the host that registers `rpc_check`
        self._lock = asyncio.Lock()
        self._per_caller = PenaltyBox(burst=per_caller, refill_per_s=1.0 / refill_s)
        self._in_total = PenaltyBox(burst=in_total, refill_per_s=in_total / refill_s, max_callers=1)
        self.dials = 0  # probes actually started

    async def register(self, p2p: P2P) -> None:
        self.p2p = p2p
        await p2p.add_protobuf_handler(RPC_REACHABILITY, self.rpc_check, runtime_pb2.ExpertRequest)

    async def rpc_check(self, request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        caller = getattr(context, "remote_id", None)
        try:
            wanted = ReachabilityRequest.model_validate_json(request.metadata)
            if caller is None or wanted.peer_id != caller.to_base58():
                raise ValueError("a caller may only ask to be dialed itself")
            if not (self._per_caller.allows(wanted.peer_id) and self._in_total.allows("all")):
                raise ValueError("rate limited")
            self._per_caller.penalize(wanted.peer_id)
            self._in_total.penalize("all")
            maddrs = [Multiaddr(m) for m in dial_back_targets(wanted.maddrs, await self._caller_hosts(caller))]
        except (ValidationError, ValueError, TypeError) as e:
            logger.info(f"Refused a reachability check: {e}")
            return _response(ReachabilityResponse(reachable=False, error=DIAL_BACK_FAILED))
        async with self._lock:
            response = await self._dial(caller, maddrs)
        return _response(response)

    async def _caller_hosts(self, caller: PeerID) -> set[str]:
        """Hosts the caller's open connections to us come from (the p2p daemon's view, not its claim)."""
        if self.p2p is None:
            return set()
        peers = await asyncio.wait_for(self.p2p.list_peers(), timeout=self.dial_timeout_s)
        return {h for info in peers if info.peer_id == caller for a in info.addrs if (h := _host_of(str(a)))}

    async def _dial(self, peer_id: PeerID, maddrs: Sequence[Multiaddr]) -> ReachabilityResponse:
        if not maddrs:
            return ReachabilityResponse(reachable=False, error=DIAL_BACK_FAILED)
        probe = None
        self.dials += 1
        try:
            probe = await asyncio.wait_for(
                P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, auto_nat=False),
                timeout=self.dial_timeout_s,
            )
            await asyncio.wait_for(probe._client.connect(peer_id, maddrs), timeout=self.dial_timeout_s)
            return ReachabilityResponse(reachable=True)
        except Exception as e:  # a failed dial surfaces as several p2pd error types; all answer alike
            logger.info(f"Reachability dial-back of {peer_id.to_base58()[-8:]} failed: {type(e).__name__}: {e}")
            return ReachabilityResponse(reachable=False, error=DIAL_BACK_FAILED)
        finally:
            if probe is not None:
                await probe.shutdown()


def _response(response: ReachabilityResponse) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=response.model_dump_json().encode())


# --- asking for the check ------------------------------------------------------------------------


async def check_reachability(
    p2p: P2P,
    helpers: Iterable[str],
    *,
    maddrs: Sequence[str] | None = None,
    max_helpers: int = 3,
    timeout_s: float = 20.0,
) -> ReachabilityReport:
    """Ask up to `max_helpers` peers (base58 ids) to dial this node at `maddrs` (default: its
    visible direct addresses)."""
    own_id = p2p.peer_id.to_base58()
    if maddrs is None:
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    tested = tuple(direct_maddrs(maddrs))
    request = runtime_pb2.ExpertRequest(
        uid="reachability",
        metadata=ReachabilityRequest(peer_id=own_id, maddrs=tested[:MAX_MADDRS]).model_dump_json().encode(),
    )
    chosen = sorted({h for h in helpers if h != own_id})[:max_helpers]

    async def ask(helper: str) -> ReachabilityResponse | None:
        try:
            raw = await asyncio.wait_for(
                p2p.call_protobuf_handler(
                    PeerID.from_base58(helper), RPC_REACHABILITY, request, runtime_pb2.ExpertResponse
                ),
                timeout=timeout_s,
            )
            return ReachabilityResponse.model_validate_json(raw.metadata)
        except Exception as e:  # the helper may be old, gone or broken: it just does not count
            logger.info(f"Reachability helper {helper[-8:]} did not answer: {type(e).__name__}: {e}")
            return None

    answers = [a for a in await asyncio.gather(*(ask(h) for h in chosen)) if a is not None]
    return ReachabilityReport(
        maddrs=tested,
        asked=len(answers),
        reachable_by=sum(a.reachable for a in answers),
        errors=tuple(a.error for a in answers if a.error),
    )
