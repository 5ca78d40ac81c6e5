"""Peers that answer "wrong stage" to calls routed by their own records are banned on that stage
after their first answer, and the run goes on (issue #30: nine such fake records, announcing a huge
throughput, were never banned and cut throughput 100x)."""

from __future__ import annotations

import json
import re

import pytest

from swarm.local_swarm import fault_args

pytestmark = pytest.mark.slow

FAKES = 3
STEPS = 4
MAX_IN_FLIGHT = 8  # the trainer's default --max-in-flight: calls that may reach a fake before its first answer
PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3"]


def fake_key(process) -> str:
    match = re.search(r"peer (\S+) online", process.log())
    assert match, process.log()
    return match.group(1)[-8:]


@pytest.mark.parametrize("routing", ["hub", "direct"])
def test_fake_wrong_stage_records_are_banned_after_their_first_answers(make_swarm, tmp_path, routing):
    """hub: the trainer gets each fake's "wrong stage" answer itself and bans it on that stage. direct:
    the stage-0 peer gets it and fails over to the route's next candidate (or the chain fails when
    the route named fakes only); the trainer hears of it from that peer, so it bans the fake for a
    short while only, as after any failed call (a peer's word about another one is not proof). The
    fakes announce 1000x the honest throughput, so without --hub-timing-fraction chains keep being
    routed to them after each short ban: nothing is lost, but the run is slower."""
    swarm = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    swarm.start_bootstrap()
    honest = [swarm.start_peer(0), swarm.start_peer(1)]
    swarm.wait_online(honest)
    fakes = [
        swarm.start_peer(1, *fault_args(wrong_stage=True, claim_speedup=1000), "--no-load-state") for _ in range(FAKES)
    ]
    swarm.wait_online(fakes)
    report_path = tmp_path / "report.json"
    trainer = swarm.start_trainer(
        *["--steps", str(STEPS), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"],
        *["--refresh-period-s", "1", "--seed", "3", "--report", str(report_path), "--routing", routing],
    )
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    report = json.loads(report_path.read_text())

    assert report["completed"] and report["microbatches_lost"] == 0
    assert all(report["calls_by_peer"].get(fake_key(fake), 0) == 0 for fake in fakes), report["calls_by_peer"]
    wrong_stage = report["failures_by_kind"].get("wrong_stage", 0)
    if routing == "direct":  # the stage-0 peer failed over from each fake it tried, saying how
        assert wrong_stage >= 1, report["failures_by_kind"]
        return
    # Each fake is tried at most by the calls in flight when it first answered, then never again.
    # Unbanned, each of the run's 16 microbatches would try every fake first, forward and backward: 96 or more.
    assert 1 <= wrong_stage <= FAKES * MAX_IN_FLIGHT, report["failures_by_kind"]
    assert all(fake.alive for fake in fakes)
