"""Several trainers on one run: two trainers read disjoint data shards and feed the same 2x2 sync
swarm, taking its steps together: a step ends when the samples of both reach the batch, and the
replicas step once per global step, not once per trainer's commit (swarm/trainer/global_step.py).
One trainer is SIGKILLed mid-run; the other finishes the run's steps alone with nothing lost, and
the replicas of every stage end with identical parameters and exactly the run's step count."""

from __future__ import annotations

import json
import re
import signal

import pytest

from models.config import get_model_config
from models.stages import build_stage
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from tests.integration.polling import wait_for
from tests.integration.processes import stop_together
from tests.integration.test_replicas import assert_same_params, stage_params

pytestmark = pytest.mark.slow

STEPS = 12  # the run's global steps: enough for the victim to start and send in some before the survivor ends
CHECKED_STEPS = 30  # every call checked: before the step-aware checks, 2 runs of 3 found honest answers apart


def start_2x2_sync_swarm(make_swarm, tmp_path, lr: float):
    """Two stages of two SGD replicas each, averaging in sync; replica r of stage s checkpoints to tmp_path/s{s}{r}."""
    swarm = make_swarm(num_stages=2, peer_args=["--optimizer", "sgd", "--lr", str(lr), "--averaging", "sync"])
    swarm.start_bootstrap()
    peers = [
        swarm.start_peer(stage, "--checkpoint-dir", str(tmp_path / f"s{stage}{replica}"))
        for stage in (0, 1)
        for replica in "ab"
    ]
    swarm.wait_online(peers)
    return swarm, peers


def run_two_trainers(swarm, peers, tmp_path, steps: int, *args: str) -> list[dict]:
    """Two trainers on shards 0/2 and 1/2 of a `steps`-step run, until both exit (0); then the peers
    are stopped. Their reports."""
    common = ["--num-stages", "2", "--batch-size", "8", "--microbatch-size", "2", "--steps", str(steps), *args]
    trainers = [
        swarm.start_trainer(*common, "--data-shard", f"{i}/2", "--report", str(tmp_path / f"t{i}.json"), name=f"t{i}")
        for i in range(2)
    ]
    for trainer in trainers:
        assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    stop_together(peers)
    return [json.loads((tmp_path / f"t{i}.json").read_text()) for i in range(2)]


def test_two_trainers_one_killed_mid_run_the_other_finishes_and_replicas_agree(make_swarm, tmp_path):
    swarm, peers = start_2x2_sync_swarm(make_swarm, tmp_path, lr=0.1)
    common = ["--num-stages", "2", "--batch-size", "8", "--microbatch-size", "2", "--log-every", "1"]
    survivor_report = tmp_path / "survivor.json"
    survivor = swarm.start_trainer(
        *common, "--steps", str(STEPS), "--data-shard", "0/2", "--report", str(survivor_report), name="survivor"
    )
    victim = swarm.start_trainer(*common, "--steps", "1000", "--data-shard", "1/2", name="victim")
    # kill the second trainer once a step it sent samples in is over (a line with its loss): it is
    # then sending the next one's
    try:
        wait_for(lambda: re.search(r"step +\d+/1000  loss +\d", victim.log()), 120, "a step the victim sent in")
    except AssertionError as e:
        raise AssertionError(
            f"{e}\n--- victim\n{victim.log()[-4000:]}\n--- survivor\n{survivor.log()[-4000:]}"
        ) from None
    victim.signal(signal.SIGKILL)
    assert survivor.popen.wait(timeout=300) == 0, survivor.log()[-3000:]
    report = json.loads(survivor_report.read_text())
    stop_together(peers)
    assert report["steps"] == STEPS and report["microbatches_lost"] == 0, report
    assert "steps are global over every trainer of run" in victim.log(), victim.log()[-2000:]
    # one optimizer step per global step: the steps the victim committed were the survivor's too
    for stage in (0, 1):
        steps = [
            load_checkpoint(checkpoint_path(str(tmp_path / f"s{stage}{r}"), "tiny", stage, 2))[0].steps_done
            for r in "ab"
        ]
        assert steps == [STEPS, STEPS], (stage, steps, survivor.log()[-3000:])
    for stage in (0, 1):
        assert_same_params(
            stage_params(tmp_path / f"s{stage}a", stage), stage_params(tmp_path / f"s{stage}b", stage), 1e-6
        )


def test_two_trainers_clip_the_shared_step_by_one_global_norm(make_swarm, tmp_path):
    """Clipping with several trainers: each trainer computes the scale from the replicas' answers to
    the step's "prepare", which every replica gives alike to every trainer (a repeated commit gets
    the first answer), so both find the same norm; a replica steps once, on the first scale it gets."""
    steps, clip = 6, 0.05  # a norm far below the gradient's: every step is clipped
    swarm, peers = start_2x2_sync_swarm(make_swarm, tmp_path, lr=0.5)
    reports = run_two_trainers(swarm, peers, tmp_path, steps, "--clip-grad-norm", str(clip))
    assert all(r["steps"] == steps and r["microbatches_lost"] == 0 for r in reports), reports
    norms = [r["grad_norms"] for r in reports]
    # a trainer that joined a step late commits from there on (under CI load one started at step 5 of 6)
    shared = min(len(n) for n in norms)
    assert shared >= 2 and norms[0][-shared:] == norms[1][-shared:], norms
    assert all(norm > clip for n in norms for norm in n), norms
    moved_sq = 0.0
    for stage in (0, 1):
        steps_done = [
            load_checkpoint(checkpoint_path(str(tmp_path / f"s{stage}{r}"), "tiny", stage, 2))[0].steps_done
            for r in "ab"
        ]
        assert steps_done == [steps, steps], (stage, steps_done)
        trained = stage_params(tmp_path / f"s{stage}a", stage)
        assert_same_params(trained, stage_params(tmp_path / f"s{stage}b", stage), 1e-6)
        initial = build_stage(get_model_config("tiny"), stage, 2).state_dict()
        moved_sq += sum(float((trained[name] - initial[name]).double().pow(2).sum()) for name in trained)
    # SGD at lr 0.5 moves the whole model by at most 0.5 x clip a step when every step is clipped
    # (unclipped, the first step alone would move it by 0.5 x norms[0][0])
    assert moved_sq**0.5 <= steps * 0.5 * clip * 1.001, (moved_sq**0.5, norms)


def test_two_trainers_that_spot_check_every_call_ban_no_honest_replica(make_swarm, tmp_path):
    """Spot checks with several trainers: one trainer's commit can step the replicas between another's
    call and its recompute. Those recomputes are of another step and are not compared (counted
    stale); every replica here is honest, so no check may find a mismatch, and none is banned. The
    last stage has three replicas, where a mismatch would ban."""
    swarm = make_swarm(num_stages=2, peer_args=["--averaging", "sync"])
    swarm.start_bootstrap()
    peers = [swarm.start_peer(0), *(swarm.start_peer(1) for _ in range(3))]
    swarm.wait_online(peers)
    reports = run_two_trainers(swarm, peers, tmp_path, CHECKED_STEPS, "--verify-fraction", "1.0")
    for report in reports:
        checked = {k: report[k] for k in ("calls_verified", "verify_mismatches", "verify_disputes", "verify_stale")}
        assert report["steps"] == CHECKED_STEPS and report["microbatches_lost"] == 0, report
        assert report["calls_verified"] > 0 and report["verify_mismatches"] == 0, checked
        assert report["banned_peers"] == {}, (report["banned_peers"], checked)
