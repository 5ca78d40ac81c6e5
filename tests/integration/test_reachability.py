"""The dial-back reachability check and the persistent identity, with real p2p daemons on loopback."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from dht.node import BootstrapError, NetworkConfig, start_dht
from dht.reachability import (
    DIAL_BACK_FAILED,
    RPC_REACHABILITY,
    DialBackService,
    ReachabilityRequest,
    ReachabilityResponse,
    check_reachability,
)

pytestmark = pytest.mark.slow


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when we return: nothing listens there


def test_dial_back_says_reachable_for_the_real_address_and_not_for_a_dead_one():
    async def main():
        helper = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        asker = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in await helper.get_visible_maddrs()]
        )
        try:
            await DialBackService(dial_timeout_s=5).register(helper)
            helper_id = helper.peer_id.to_base58()
            good = await check_reachability(asker, [helper_id], timeout_s=30)
            bad = await check_reachability(
                asker, [helper_id], maddrs=[f"/ip4/127.0.0.1/tcp/{closed_port()}"], timeout_s=30
            )
            nobody = await check_reachability(asker, [], timeout_s=5)
            return good, bad, nobody
        finally:
            await asker.shutdown()
            await helper.shutdown()

    good, bad, nobody = asyncio.run(main())
    assert good.asked == 1 and good.reachable is True, good
    assert bad.asked == 1 and bad.reachable is False and bad.errors, bad
    assert nobody.reachable is None


def test_dial_back_refuses_foreign_addresses_and_other_peer_ids_without_dialing_and_is_rate_limited():
    async def main():
        helper = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        asker = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in await helper.get_visible_maddrs()]
        )
        service = DialBackService(dial_timeout_s=5, per_caller=2, in_total=100)
        try:
            await service.register(helper)
            helper_id = helper.peer_id.to_base58()
            # Another machine's address: the helper must not become a port scanner.
            foreign = await check_reachability(asker, [helper_id], maddrs=["/ip4/192.0.2.1/tcp/22"], timeout_s=30)

            async def ask_for(peer_id: str) -> ReachabilityResponse:
                request = runtime_pb2.ExpertRequest(
                    metadata=ReachabilityRequest(peer_id=peer_id, maddrs=("/ip4/127.0.0.1/tcp/22",))
                    .model_dump_json()
                    .encode()
                )
                raw = await asker.call_protobuf_handler(
                    helper.peer_id, RPC_REACHABILITY, request, runtime_pb2.ExpertResponse
                )
                return ReachabilityResponse.model_validate_json(raw.metadata)

            someone_else = await ask_for(helper_id)  # "dial that peer", asked by another
            dials_before = service.dials
            own = [await check_reachability(asker, [helper_id], timeout_s=30) for _ in range(2)]
            return foreign, someone_else, dials_before, own, service.dials
        finally:
            await asker.shutdown()
            await helper.shutdown()

    foreign, someone_else, dials_before, own, dials_after = asyncio.run(main())
    assert foreign.asked == 1 and foreign.reachable is False and foreign.errors == (DIAL_BACK_FAILED,), foreign
    assert someone_else.reachable is False and someone_else.error == DIAL_BACK_FAILED
    assert dials_before == 0  # refused before any probe was started
    # Its own address is dialed; then the caller has used its 2 checks (the foreign one counted) and is refused alike.
    assert own[0].reachable is True and dials_after == 1
    assert own[1].reachable is False and own[1].errors == (DIAL_BACK_FAILED,)


def test_identity_file_gives_the_same_peer_id_across_restarts(tmp_path):
    path = str(tmp_path / "peer.key")
    ids = []
    for _ in range(2):
        dht = start_dht(NetworkConfig(identity_path=path))
        try:
            ids.append(dht.peer_id.to_base58())
        finally:
            dht.shutdown()
    assert ids[0] == ids[1]
    other = start_dht(NetworkConfig(identity_path=str(tmp_path / "other.key")))
    try:
        assert other.peer_id.to_base58() != ids[0]
    finally:
        other.shutdown()


def test_a_damaged_identity_file_is_a_clear_error(tmp_path):
    path = tmp_path / "peer.key"
    path.write_bytes(b"not a key")
    with pytest.raises(BootstrapError, match="identity"):
        start_dht(NetworkConfig(identity_path=str(path), startup_timeout_s=10))
