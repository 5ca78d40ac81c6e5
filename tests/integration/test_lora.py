"""Fine-tuning with adapters (`--trainable lora:8`) on a 2x2 swarm: the loss falls, only the
adapters are averaged (one round's bytes are the adapters' size, not the stage's) and checkpointed,
and the two replicas of a stage hold the same adapters."""

from __future__ import annotations

from dataclasses import replace
from importlib.util import find_spec

import pytest

from models.config import get_model_config
from models.lora import add_adapters
from models.stages import build_stage
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from tests.integration.test_replicas import assert_same_params, averaging_sample, run_trainer, scrape

# Looked up, not imported: importing peft (and transformers with it) costs every collection of the
# suite about 4 s, and the peers import it themselves.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(find_spec("peft") is None, reason="peft is not installed")]

RANK, STEPS = 8, 8


def test_a_2x2_swarm_fine_tunes_adapters_only(make_swarm, tmp_path):
    # SGD: under AdamW the replicas part by up to lr on values whose averaged gradient nearly
    # cancels (the all-reduce's last-bit differences, normalised), which would hide a real drift.
    swarm = make_swarm(
        num_stages=2,
        peer_args=[
            "--trainable",
            f"lora:{RANK}",
            "--optimizer",
            "sgd",
            "--lr",
            "2.0",
            "--target-batch-size",
            "8",
            "--averaging",
            "sync",
        ],
    )
    swarm.start_bootstrap()
    peers = [swarm.start_peer(s, "--checkpoint-dir", str(tmp_path / f"c{i}")) for i, s in enumerate([0, 0, 1, 1])]
    swarm.wait_online(peers)
    report = run_trainer(
        swarm,
        tmp_path,
        "--trainable",
        f"lora:{RANK}",
        "--steps",
        str(STEPS),
        "--batch-size",
        "8",
        "--microbatch-size",
        "2",
    )
    metrics = [scrape(peer) for peer in peers]
    for peer in peers:
        peer.stop()
    losses = report["losses"]
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < losses[0] - 0.05, losses

    config = replace(get_model_config("tiny"), trainable=f"lora:{RANK}")
    for stage, replicas in [(0, (0, 1)), (1, (2, 3))]:
        module = build_stage(config, stage, 2)
        full_values = sum(p.numel() for p in module.parameters())
        adapter_values = add_adapters(module, RANK)
        states = [load_checkpoint(checkpoint_path(str(tmp_path / f"c{i}"), "tiny", stage, 2))[1] for i in replicas]
        assert all(".lora_" in name for name in states[0]), sorted(states[0])  # the base is not checkpointed
        assert sum(t.numel() for t in states[0].values()) == adapter_values
        assert_same_params(states[0], states[1], atol=1e-6)
        for i in replicas:  # every step one round; each round moves the adapters' gradients, 4 bytes a value
            rounds = averaging_sample(metrics[i], "swarm_peer_averaging_rounds_total", mode="sync", result="ok") or 0
            sent = averaging_sample(metrics[i], "swarm_peer_averaging_bytes_total", mode="sync", direction="sent")
            # a replica that lost part of a round (hivemind's all-reduce can, under load) fails it and
            # loads its partner's state (the trainer's repair): one round fewer for each repair
            assert STEPS - report["replica_catch_ups"] <= rounds <= STEPS, (rounds, report["replica_catch_ups"])
            assert 4 * adapter_values <= sent / rounds <= 4.05 * adapter_values < 4 * full_values, (sent, rounds)
