"""Every call checkable (issue #59), on real processes: liars at the last stage (its fused call: the
loss and the input gradient every earlier stage trains on), a lying backward at stage 0, and a bf16
stage, each caught by the trainer's spot checks (--verify-fraction) under direct and hub routing;
the liars, and only they, are banned, nothing is lost, and the run ends within 2% of a clean run.

For each routing, one swarm of liars and one clean swarm, started fresh: stage 0 has two honest
replicas (and a replica lying on its backward calls alone), stage 1 two honest replicas and one liar
of each plausible kind. Both start from the same weights, so the lying run's loss differs from the
clean run's only by what the liars did before their bans. (Swarms shared by both routings compounded
the first run's harm into the second's: on main's CI the hub run once ended 2.6% from its clean run.)"""

from __future__ import annotations

import json
import re

import pytest

from swarm.local_swarm import fault_args

pytestmark = pytest.mark.slow

PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3"]
# the last stage's liars: kind, relative size (scale and noise), its name
LAST_STAGE_LIES = [("scale", "0.05"), ("noise", "0.03"), ("replay", "0.05"), ("stale", "0.05")]
# steps of each run: a stale liar answers right until the first step, and each of the four last-stage
# liars must draw a checked call after it (4 steps missed one of them in 2 of 4 loaded CI runs)
STEPS = 6
GOAL_LOSS_REL = 0.02


def peer_id(process) -> str:
    match = re.search(r"peer (\S+) online", process.log())
    assert match, process.log()
    return match.group(1)


def lie(kind: str, size: str, calls: str = "all") -> list[str]:
    return fault_args(garbage=kind, garbage_size=float(size), garbage_rate=1.0, garbage_calls=calls)


@pytest.fixture
def swarms(make_swarm):
    """(clean swarm, lying swarm, liar name -> process, honest processes of the lying swarm)."""
    clean = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    lying = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    for swarm in (clean, lying):
        swarm.start_bootstrap()
    clean_peers = [clean.start_peer(stage) for stage in (0, 0, 1, 1)]
    honest = [lying.start_peer(stage) for stage in (0, 0, 1, 1)]
    liars = {"backward": lying.start_peer(0, *lie("scale", "0.05", calls="backward"), name="peer-s0-liar-backward")}
    for kind, size in LAST_STAGE_LIES:
        liars[kind] = lying.start_peer(1, *lie(kind, size), name=f"peer-s1-liar-{kind}")
    clean.wait_online(clean_peers, timeout_s=180)
    lying.wait_online([*honest, *liars.values()], timeout_s=180)
    return clean, lying, liars, honest


def train(swarm, tmp_path, name: str, routing: str, *args: str) -> dict:
    report_path = tmp_path / f"{name}.json"
    trainer = swarm.start_trainer(
        *("--steps", str(STEPS), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"),
        *("--refresh-period-s", "1", "--seed", "3", "--eval-every", str(STEPS), "--eval-batches", "2"),
        *("--verify-fraction", "0.5", "--routing", routing, "--report", str(report_path), *args),
        name=f"trainer-{name}",
    )
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    return json.loads(report_path.read_text())


@pytest.mark.parametrize("routing", ["direct", "hub"])
def test_liars_at_the_last_stage_and_a_lying_backward_at_stage_0_are_banned_and_only_they(swarms, tmp_path, routing):
    clean, lying, liars, honest = swarms
    clean_report = train(clean, tmp_path, f"clean-{routing}", routing)
    report = train(lying, tmp_path, f"lying-{routing}", routing)

    for run in (clean_report, report):
        assert run["completed"] and run["microbatches_lost"] == 0, run
    assert clean_report["banned_peers"] == {} and clean_report["verify_mismatches"] == 0
    liar_ids = {kind: peer_id(process) for kind, process in liars.items()}
    assert set(report["banned_peers"]) == set(liar_ids.values()), (liar_ids, report["banned_peers"])
    for kind, liar in liar_ids.items():
        reason = report["banned_peers"][liar]
        assert ("stage 0: its" if kind == "backward" else "stage 1: its last stage's") in reason, (kind, reason)
        counts = report["contributions"][liar]
        # Checks can find some of a liar's samples right: the backward liar answers its forwards
        # honestly, and a stale liar's frozen weights equal the training ones until the first step.
        assert counts["mismatches"] >= 1, (kind, counts)
    for process in honest:
        counts = report["contributions"][peer_id(process)]
        # An honest replica counts a mismatch only in a check no majority decided: one honest answer
        # among four liars' (five opinions at most, the liars not yet banned), each lie its own.
        assert counts["banned"] is None and counts["mismatches"] <= report["verify_undecided"], counts
    assert sum(report["contributions"][peer_id(p)]["samples_verified"] for p in honest) > 0
    # every kind of call was checked, and honest float32 replicas stayed well within the bound
    assert {"forward", "backward", "last"} <= set(report["calls_verified_by_call"]), report["calls_verified_by_call"]
    assert clean_report["verify_largest_agreeing_share"] < 0.5, clean_report["verify_largest_agreeing_share"]
    if routing == "direct":
        assert report["verify_records_missing"] < report["calls_verified"], report
    rel = (report["final_eval_loss"] - clean_report["final_eval_loss"]) / clean_report["final_eval_loss"]
    assert abs(rel) <= GOAL_LOSS_REL, (rel, report["final_eval_loss"], clean_report["final_eval_loss"])
    for process in liars.values():
        assert process.alive  # banned, not crashed


def test_three_bf16_replicas_one_lying_by_three_percent_two_disagreeing_first(module_swarm, tmp_path):
    """Stage 1 served in bf16 (each replica announces it): an honest bf16 answer is held to the bf16
    bound against a float32 recompute, and a liar scaling by 3% exceeds it. With only the liar and
    one honest replica, a mismatch is a dispute (nobody banned, the report says so); once a third
    replica has joined, the liar is banned and the honest ones never are."""
    swarm = module_swarm(num_stages=2, peer_args=PEER_ARGS)
    swarm.start_bootstrap()
    first = swarm.start_peer(0)
    honest = [swarm.start_peer(1, "--precision", "bf16")]
    liar = swarm.start_peer(1, "--precision", "bf16", *lie("scale", "0.03"), name="peer-s1-liar")
    swarm.wait_online([first, *honest, liar], timeout_s=180)

    alone = train(swarm, tmp_path, "two-replicas", "direct")
    assert alone["completed"] and alone["microbatches_lost"] == 0 and alone["banned_peers"] == {}
    assert alone["verify_disputes"] >= 1 and alone["verify_disputes_unresolved"] == alone["verify_disputes"]
    assert {tuple(d["peers"]) for d in alone["disputes"]} <= {
        (peer_id(honest[0]), peer_id(liar)),
        (peer_id(liar), peer_id(honest[0])),
    }
    assert alone["contributions"][peer_id(liar)]["disputes"] >= 1

    honest.append(swarm.start_peer(1, "--precision", "bf16"))
    swarm.wait_online(honest[1:], timeout_s=180)
    report = train(swarm, tmp_path, "three-replicas", "direct")
    assert report["completed"] and report["microbatches_lost"] == 0
    assert list(report["banned_peers"]) == [peer_id(liar)], report["banned_peers"]
    for process in honest:
        assert report["contributions"][peer_id(process)]["banned"] is None
    assert 0.0 < report["verify_largest_agreeing_share"] < 1.0
