"""The pure parts of the reachability check: which addresses are dialled, and what a volunteer is told."""

from __future__ import annotations

from dht.reachability import ReachabilityReport, address_scope, direct_maddrs, verdict

ID = "12D3KooWFA18rYgnxD833hzMdmuKhUUEfH7Qjj7eSry19gAMGyHS"


def test_relay_circuits_are_not_direct_addresses():
    maddrs = [
        f"/ip4/1.2.3.4/tcp/31337/p2p/{ID}",
        f"/ip4/5.6.7.8/tcp/4001/p2p/{ID}/p2p-circuit/p2p/{ID}",
        "/ip4/1.2.3.4/tcp/31337",
    ]
    assert direct_maddrs(maddrs) == ["/ip4/1.2.3.4/tcp/31337"]


def test_address_scopes():
    assert address_scope("/ip4/127.0.0.1/tcp/1") == "loopback"
    assert address_scope("/ip6/::1/tcp/1") == "loopback"
    assert address_scope("/ip4/192.168.1.5/tcp/1") == "private"
    assert address_scope("/ip4/100.64.3.2/tcp/1") == "private"  # carrier-grade NAT
    assert address_scope("/ip4/8.8.8.8/tcp/1") == "public"
    assert address_scope("/dns4/example.org/tcp/1") == "name"


def test_unreachable_says_what_to_do():
    report = ReachabilityReport(maddrs=("/ip4/192.168.1.5/tcp/31337",), asked=2, reachable_by=0, errors=("refused",))
    line = verdict(report, use_auto_relay=False)
    assert "NOT reachable" in line and "0/2" in line
    assert "--announce-maddrs" in line and "--use-auto-relay" in line and "\n" not in line
    assert "may still be reached through a relay" in verdict(report, use_auto_relay=True)


def test_reachable_and_unknown():
    ok = ReachabilityReport(maddrs=("/ip4/8.8.8.8/tcp/31337",), asked=3, reachable_by=2)
    assert verdict(ok, use_auto_relay=False).startswith("reachability: 2/3 peer(s) could dial")
    alone_loopback = ReachabilityReport(maddrs=("/ip4/127.0.0.1/tcp/4000",), asked=0, reachable_by=0)
    assert alone_loopback.reachable is None
    assert "only processes on this machine" in verdict(alone_loopback, use_auto_relay=False)
    alone_private = ReachabilityReport(maddrs=("/ip4/10.0.0.2/tcp/4000",), asked=0, reachable_by=0)
    assert "no public address" in verdict(alone_private, use_auto_relay=False)
    nothing = ReachabilityReport(maddrs=(), asked=0, reachable_by=0)
    assert "--use-auto-relay" in verdict(nothing, use_auto_relay=False)
