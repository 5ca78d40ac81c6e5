"""Can others reach this node directly? A dial-back check, and advice a volunteer can act on.

hivemind 1.1.12 has no reachability check of its own (AutoNAT runs inside p2pd and its verdict
is not exposed), so peers help each other: a peer serves `RPC_REACHABILITY`; asked with a peer id
and its multiaddrs, it starts a short-lived probe daemon (its own identity, relays off, so it
cannot reuse an existing connection or go through a relay), dials those addresses and answers
whether the handshake succeeded. A starting peer asks a few online peers and prints the verdict.

The pure parts (`direct_maddrs`, `address_scope`, `verdict`) hold every decision.
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


class DialBackService:
    """The `RPC_REACHABILITY` handler. One probe at a time; each probe daemon lives for one check."""

    def __init__(self, *, dial_timeout_s: float = 10.0):
        self.dial_timeout_s = dial_timeout_s
        self._lock = asyncio.Lock()

    async def register(self, p2p: P2P) -> None:
        await p2p.add_protobuf_handler(RPC_REACHABILITY, self.rpc_check, runtime_pb2.ExpertRequest)

    async def rpc_check(self, request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        try:
            wanted = ReachabilityRequest.model_validate_json(request.metadata)
            peer_id = PeerID.from_base58(wanted.peer_id)
            maddrs = [Multiaddr(m) for m in direct_maddrs(wanted.maddrs)]
        except (ValidationError, ValueError, TypeError) as e:
            return _response(ReachabilityResponse(reachable=False, error=f"malformed request: {e}"[:500]))
        async with self._lock:
            response = await self._dial(peer_id, maddrs)
        return _response(response)

    async def _dial(self, peer_id: PeerID, maddrs: Sequence[Multiaddr]) -> ReachabilityResponse:
        if not maddrs:
            return ReachabilityResponse(reachable=False, error="no direct address to dial")
        probe = None
        try:
            probe = await asyncio.wait_for(
                P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, auto_nat=False),
                timeout=self.dial_timeout_s,
            )
            await asyncio.wait_for(probe._client.connect(peer_id, maddrs), timeout=self.dial_timeout_s)
            return ReachabilityResponse(reachable=True)
        except TimeoutError:
            return ReachabilityResponse(reachable=False, error=f"no answer within {self.dial_timeout_s:.0f} s")
        except Exception as e:  # a failed dial surfaces as several p2pd error types
            return ReachabilityResponse(reachable=False, error=f"{type(e).__name__}: {e}"[:500])
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
