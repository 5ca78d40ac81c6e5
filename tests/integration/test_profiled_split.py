"""A swarm started with a profiled (unequal) split computes what one process computes, and never
mixes two splits: a later peer adopts the swarm's split, a peer asking for another one refuses."""

from __future__ import annotations

import json

import pytest
import torch

from models.balanced_split import SplitCosts, balanced_split
from models.config import get_model_config
from models.stages import build_full_model, equal_boundaries
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from tests.integration.processes import stop_together
from tests.integration.test_correctness import BATCH, MICROBATCH, reference_update

pytestmark = pytest.mark.slow


def test_profiled_split_trains_like_one_process_and_is_never_mixed(make_swarm, tmp_path):
    config = get_model_config("tiny")
    # Stage 0 on a device half as fast: the splitter gives it fewer blocks than the equal split.
    split = balanced_split(SplitCosts(block_s=(1.0,) * config.n_layers), 2, stage_speeds=[0.5, 1.0])
    boundaries = split.boundaries
    assert boundaries == (0, 1, 3) and boundaries != equal_boundaries(config.n_layers, 2)
    flag = ",".join(map(str, boundaries))

    kind, lr = "sgd", 0.5
    ckpt = str(tmp_path / "ckpt")
    swarm = make_swarm(
        num_stages=2,
        peer_args=["--optimizer", kind, "--lr", str(lr), "--target-batch-size", str(BATCH), "--checkpoint-dir", ckpt],
    )
    swarm.start_bootstrap()
    first = swarm.start_peer(0, "--split-boundaries", flag)
    swarm.wait_online([first])
    adopter = swarm.start_peer(1)  # no flag: takes the split the swarm already serves
    rogue = swarm.start_peer(1, "--split-boundaries", "0,2,3", name="peer-rogue")
    assert rogue.popen.wait(timeout=120) == 2, rogue.log()
    assert "--split-boundaries 0,2,3 (the run's: 0,1,3)" in rogue.log() and "Traceback" not in rogue.log()
    swarm.wait_online([adopter])

    report_path = str(tmp_path / "report.json")
    trainer = swarm.start_trainer(
        "--steps",
        "1",
        "--batch-size",
        str(BATCH),
        "--microbatch-size",
        str(MICROBATCH),
        "--num-stages",
        "2",
        "--report",
        report_path,
    )
    assert trainer.popen.wait(timeout=180) == 0, trainer.log()
    stop_together([first, adopter])  # a clean exit writes each stage's checkpoint
    with open(report_path) as f:
        report = json.load(f)
    assert report["split_boundaries"] == list(boundaries)

    ref_loss, ref_params = reference_update(config, kind, lr)
    assert report["losses"][0] == pytest.approx(ref_loss, abs=1e-5)
    assert report["microbatches_lost"] == 0
    initial = dict(build_full_model(config).named_parameters())
    compared = 0
    for stage in range(2):
        meta, state, _ = load_checkpoint(checkpoint_path(ckpt, "tiny", stage, 2, split_tag=flag.replace(",", "-")))
        assert meta.steps_done == 1
        blocks = {int(name.split(".")[1]) for name in state if name.startswith("blocks.")}
        assert len(blocks) == boundaries[stage + 1] - boundaries[stage]
        for name, value in state.items():
            if name.startswith("blocks."):
                index = int(name.split(".")[1]) + boundaries[stage]
                name = f"blocks.{index}." + name.split(".", 2)[2]
            torch.testing.assert_close(value, ref_params[name].detach(), atol=1e-5, rtol=0)
            assert not torch.equal(value, initial[name].detach()), f"{name} did not change"
            compared += 1
    assert compared == len(ref_params)
