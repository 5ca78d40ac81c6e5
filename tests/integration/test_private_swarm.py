"""Private swarms (issue #11): a peer started with --allowed-peers serves only the listed peer ids,
refuses others with a clear error, and readers with an allowlist ignore records of other peers."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from dht.announce import fetch_stage_records
from dht.node import NetworkConfig, start_dht
from dht.signing import load_identity, new_identity_file
from models.config import get_model_config
from swarm.trainer.client import PeerCallError, StageClient
from wire.failures import Failure
from wire.tensors import encode_tensor

pytestmark = pytest.mark.slow


def test_a_private_peer_serves_only_allowed_peers(make_swarm, tmp_path):
    paths = {name: str(tmp_path / f"{name}.key") for name in ("peer", "trainer")}
    for path in paths.values():
        new_identity_file(path)
    ids = {name: load_identity(path).peer_id for name, path in paths.items()}
    swarm = make_swarm(num_stages=2, run=False)  # --allowed-peers alone, without a run authority
    swarm.start_bootstrap()
    peer = swarm.start_peer(1, "--identity-path", paths["peer"], "--allowed-peers", ids["peer"], ids["trainer"])
    swarm.wait_online([peer])
    config = get_model_config("tiny")
    allowed = start_dht(
        NetworkConfig(
            initial_peers=swarm.initial_peers,
            identity_path=paths["trainer"],
            allowed_peers=[ids["peer"], ids["trainer"]],
        ),
        client_mode=True,
    )
    stranger = start_dht(
        NetworkConfig(initial_peers=swarm.initial_peers, allowed_peers=[ids["trainer"]]), client_mode=True
    )

    async def backward(dht):
        client = StageClient(await dht.replicate_p2p(), model="tiny", num_stages=2)
        tensors = [
            ("inputs", encode_tensor(torch.randn(2, config.seq_len, config.d_model))),
            ("targets", encode_tensor(torch.randint(0, config.vocab_size, (2, config.seq_len)))),
        ]
        return await client.call(
            ids["peer"], rpc="backward", stage=1, microbatch_id="m", batch_size=2, tensors=tensors, timeout_s=60
        )

    try:
        assert [r.peer_id for r in fetch_stage_records(allowed, "tiny", 1)] == [ids["peer"]]
        assert fetch_stage_records(stranger, "tiny", 1) == []  # its allowlist does not name the peer
        outputs, response, _ = asyncio.run(backward(allowed))
        assert response.loss > 0
        with pytest.raises(PeerCallError, match="private swarm") as refused:
            asyncio.run(backward(stranger))
        assert refused.value.kind == Failure.REFUSED
        assert stranger.peer_id.to_base58() in str(refused.value)
    finally:
        allowed.shutdown()
        stranger.shutdown()
    assert peer.alive


def test_a_trainer_refused_by_a_private_swarm_says_so_and_names_its_peer_id(make_swarm, tmp_path):
    key = str(tmp_path / "peer.key")
    new_identity_file(key)
    swarm = make_swarm(num_stages=1, peer_args=["--averaging", "none", "--reachability-check", "off"], run=False)
    swarm.start_bootstrap()
    peer = swarm.start_peer(0, "--identity-path", key, "--allowed-peers", load_identity(key).peer_id)
    swarm.wait_online([peer])
    trainer = swarm.start_trainer("--steps", "5", "--batch-size", "4", "--num-stages", "1")
    trainer.popen.wait(timeout=120)  # well within one --stage-wait-timeout-s (300 s)
    log = trainer.log()
    my_id = re.search(r"^trainer (\w+) starting", log, re.MULTILINE).group(1)
    errors = [line for line in log.splitlines() if line.startswith("swarm train: error:")]
    assert trainer.popen.returncode == 2 and len(errors) == 1, log
    assert "refused" in errors[0] and "private swarm" in errors[0] and my_id in errors[0], errors[0]
    assert "Traceback" not in log
