"""Peers that answer "wrong stage" to calls routed by their own records are banned on that stage
after their first answer, and the run goes on (issue #30: nine such fake records, announcing a huge
throughput, were never banned and cut throughput 100x)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

FAKES = 3
STEPS = 4
MAX_IN_FLIGHT = 8  # the trainer's default --max-in-flight: calls that may reach a fake before its first answer
PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3"]


def test_fake_wrong_stage_records_are_banned_after_their_first_answers(make_swarm, tmp_path):
    swarm = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    swarm.start_bootstrap()
    honest = [swarm.start_peer(0), swarm.start_peer(1)]
    swarm.wait_online(honest)
    fakes = [
        swarm.start_peer(1, "--fault-wrong-stage", "--fault-claim-speedup", "1000", "--no-load-state")
        for _ in range(FAKES)
    ]
    swarm.wait_online(fakes)
    report_path = tmp_path / "report.json"
    trainer = swarm.start_trainer(
        *["--steps", str(STEPS), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"],
        *["--refresh-period-s", "1", "--seed", "3", "--report", str(report_path)],
    )
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    report = json.loads(report_path.read_text())

    assert report["completed"] and report["microbatches_lost"] == 0
    wrong_stage = report["failures_by_kind"].get("wrong_stage", 0)
    # Each fake is tried at most by the calls in flight when it first answered, then never again.
    # Unbanned, each of the run's 16 microbatches would try every fake first, forward and backward: 96 or more.
    assert 1 <= wrong_stage <= FAKES * MAX_IN_FLIGHT, report["failures_by_kind"]
    assert all(fake.alive for fake in fakes)
