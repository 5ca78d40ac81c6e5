"""A replica that lies plausibly (outputs scaled by 1.05: right shape, finite) passes the answer
check; the trainer's spot checks (--verify-fraction) catch it among three replicas of its stage and
ban it for the run, and no microbatch is lost (issue #25)."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.slow

PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3"]


def peer_id(process) -> str:
    match = re.search(r"peer (\S+) online", process.log())
    assert match, process.log()
    return match.group(1)


def test_a_replica_scaling_its_outputs_is_banned_by_spot_checks(make_swarm, tmp_path):
    swarm = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    swarm.start_bootstrap()
    honest = [swarm.start_peer(0), swarm.start_peer(0), swarm.start_peer(1)]
    liar = swarm.start_peer(0, "--fault-garbage", "scale", "--fault-garbage-rate", "1.0", "--no-load-state")
    swarm.wait_online([*honest, liar])
    report_path = tmp_path / "report.json"
    trainer = swarm.start_trainer(
        *("--steps", "4", "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"),
        *("--refresh-period-s", "1", "--verify-fraction", "0.5", "--report", str(report_path)),
    )
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    report = json.loads(report_path.read_text())

    assert report["completed"] and report["microbatches_lost"] == 0
    assert list(report["banned_peers"]) == [peer_id(liar)], report["banned_peers"]
    assert "differed" in report["banned_peers"][peer_id(liar)]
    assert report["calls_verified"] >= 1 and report["verify_mismatches"] >= 1
    assert report["verify_calls"] > report["calls_verified"]  # the cost: a second call each, a third on a mismatch
    for process in honest:  # honest replicas agree with each other: never banned
        assert peer_id(process) not in report["banned_peers"]
    assert liar.alive  # banned, not crashed
