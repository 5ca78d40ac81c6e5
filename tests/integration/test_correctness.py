"""A pipeline without compression computes what one process computes: same loss, same update."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from models.config import get_model_config
from models.stages import build_full_model, stage_spec
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from peers.compute.stage_runtime import OptimizerSettings
from swarm.trainer.data import MicrobatchSampler, open_data
from tests.integration.processes import stop_together

pytestmark = pytest.mark.slow

BATCH, MICROBATCH = 8, 2


def reference_update(config, kind: str, lr: float):
    sampler = MicrobatchSampler(
        open_data(None).train, seq_len=config.seq_len, batch_size=BATCH, microbatch_size=MICROBATCH
    )
    microbatches = sampler.batch(0)
    inputs = torch.cat([mb.inputs for mb in microbatches])
    targets = torch.cat([mb.targets for mb in microbatches])
    model = build_full_model(config)
    optimizer = OptimizerSettings(optimizer=kind, lr=lr).build(model.parameters())
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    return loss.item(), dict(model.named_parameters())


KIND, LR = "sgd", 0.5  # SGD: the update is the gradient itself, so a wrong scale would show
# cache_size 0: every backward sent without inputs (to the peer that served the forward) misses
# the activation cache, and the trainer must resend it with the inputs.
CASES = [(2, 64), (3, 64), (3, 0)]


@pytest.fixture(scope="module")
def one_step_runs(module_swarm, tmp_path_factory):
    """Every case's swarm trains its one step side by side (the swarms share nothing; most of
    each one's time is its processes starting): {case: (trainer exit code, trainer log, report
    path, checkpoint folder)}, read once each stage's peer has stopped and saved its checkpoint."""
    started = {}
    for num_stages, cache_size in CASES:
        workdir = tmp_path_factory.mktemp(f"one-step-{num_stages}-{cache_size}")
        ckpt = str(workdir / "ckpt")
        swarm = module_swarm(
            num_stages=num_stages,
            peer_args=["--optimizer", KIND, "--lr", str(LR), "--target-batch-size", str(BATCH),
                       "--checkpoint-dir", ckpt, "--activation-cache-size", str(cache_size)],
        )  # fmt: skip
        swarm.start_bootstrap()
        started[num_stages, cache_size] = (swarm, [swarm.start_peer(stage) for stage in range(num_stages)], workdir)
    trainers = {}
    for (num_stages, cache_size), (swarm, peers, workdir) in started.items():
        swarm.wait_online(peers)
        trainers[num_stages, cache_size] = swarm.start_trainer(
            "--steps", "1", "--batch-size", str(BATCH), "--microbatch-size", str(MICROBATCH),
            "--num-stages", str(num_stages), "--report", str(workdir / "report.json"),
        )  # fmt: skip
    runs = {}
    for case, (swarm, peers, workdir) in started.items():
        trainer = trainers[case]
        try:
            code = trainer.popen.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = None
        stop_together(peers)  # a clean exit writes each stage's checkpoint
        runs[case] = (code, trainer.log(), workdir / "report.json", str(workdir / "ckpt"))
    return runs


@pytest.mark.parametrize(("num_stages", "cache_size"), CASES)
def test_one_step_through_the_swarm_matches_one_process(one_step_runs, num_stages, cache_size):
    config = get_model_config("tiny")
    code, log, report_path, ckpt = one_step_runs[num_stages, cache_size]
    assert code == 0, log
    with open(report_path) as f:
        report = json.load(f)

    ref_loss, ref_params = reference_update(config, KIND, LR)
    assert report["losses"][0] == pytest.approx(ref_loss, abs=1e-5)
    assert report["microbatches_lost"] == 0
    backwards_with_cache = (BATCH // MICROBATCH) * (num_stages - 1)  # the last stage's fused call needs its inputs
    if cache_size:
        assert (report["backward_inputs_skipped"], report["backward_inputs_resent"]) == (backwards_with_cache, 0)
    else:
        assert (report["backward_inputs_skipped"], report["backward_inputs_resent"]) == (0, backwards_with_cache)
    initial = dict(build_full_model(config).named_parameters())
    compared = 0
    for stage in range(num_stages):
        meta, state, _ = load_checkpoint(checkpoint_path(ckpt, "tiny", stage, num_stages))
        assert meta.steps_done == 1
        offset = stage_spec(config, stage, num_stages).first_layer
        for name, value in state.items():
            if name.startswith("blocks."):
                index = int(name.split(".")[1]) + offset
                name = f"blocks.{index}." + name.split(".", 2)[2]
            torch.testing.assert_close(value, ref_params[name].detach(), atol=1e-5, rtol=0)
            assert not torch.equal(value, initial[name].detach()), f"{name} did not change"
            compared += 1
    assert compared == len(ref_params)
