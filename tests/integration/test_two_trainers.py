"""Several trainers on one run: two trainers read disjoint data shards and feed the same 2x2 sync
swarm; one is SIGKILLed mid-run. The other finishes with nothing lost, and the replicas of every
stage end with identical parameters (what a trainer dying in the middle of a step left in a
replica's gradients is averaged into the next commit like everything else)."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.integration.polling import wait_for
from tests.integration.processes import stop_together
from tests.integration.test_replicas import assert_same_params, stage_params

pytestmark = pytest.mark.slow


def test_two_trainers_one_killed_mid_run_the_other_finishes_and_replicas_agree(make_swarm, tmp_path):
    swarm = make_swarm(num_stages=2, peer_args=["--optimizer", "sgd", "--lr", "0.1", "--averaging", "sync"])
    swarm.start_bootstrap()
    peers = [
        swarm.start_peer(stage, "--checkpoint-dir", str(tmp_path / f"s{stage}{replica}"))
        for stage in (0, 1)
        for replica in "ab"
    ]
    swarm.wait_online(peers)
    common = ["--num-stages", "2", "--batch-size", "8", "--microbatch-size", "2", "--log-every", "1"]
    survivor_report = tmp_path / "survivor.json"
    survivor = swarm.start_trainer(
        *common, "--steps", "8", "--data-shard", "0/2", "--report", str(survivor_report), name="survivor"
    )
    victim = swarm.start_trainer(*common, "--steps", "1000", "--data-shard", "1/2", name="victim")
    # kill the second trainer once it has finished two steps: it is then in the middle of its third
    wait_for(lambda: re.search(r"step +2/1000", victim.log()), timeout_s=120, what="the victim's second step")
    victim.signal(signal.SIGKILL)
    assert survivor.popen.wait(timeout=300) == 0, survivor.log()[-3000:]
    report = json.loads(survivor_report.read_text())
    stop_together(peers)
    assert report["steps"] == 8 and report["microbatches_lost"] == 0, report
    assert report["microbatches_sent"] >= 8 * 4, report
    for stage in (0, 1):
        assert_same_params(
            stage_params(tmp_path / f"s{stage}a", stage), stage_params(tmp_path / f"s{stage}b", stage), 1e-6
        )
