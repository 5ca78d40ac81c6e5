"""A peer that answers with garbage (NaNs, a wrong shape) is banned by the trainer, and training
goes on with the same losses as a clean run (issue #11)."""

from __future__ import annotations

import json
import re

import pytest

from swarm.local_swarm import fault_args

pytestmark = pytest.mark.slow

STEPS = 6
PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3"]
TRAIN_ARGS = [
    "--steps",
    str(STEPS),
    "--batch-size",
    "8",
    "--microbatch-size",
    "2",
    "--num-stages",
    "2",
    "--refresh-period-s",
    "1",
    "--seed",
    "3",
]


def peer_key(process) -> str:
    match = re.search(r"peer (\S+) online", process.log())
    assert match, process.log()
    return match.group(1)[-8:]


def finish(trainer, report_path) -> dict:
    assert trainer.popen.wait(timeout=400) == 0, trainer.log()[-3000:]
    return json.loads(report_path.read_text())


@pytest.mark.parametrize("routing", ["hub", "direct"])
def test_peers_returning_nan_or_wrong_shapes_are_banned_and_the_loss_is_unaffected(make_swarm, tmp_path, routing):
    """hub: the trainer sees each garbage answer itself and bans the peer everywhere, for long. direct:
    the peer before the garbage replica sees it and fails over to the route's next candidate; the
    trainer learns only that the hop failed over (a peer's word about another peer, which a liar
    could use against an honest one), so the replica is routed around for a short ban, as after any
    failed call, and tried again after it."""
    # Two swarms side by side: the clean run trains while the dirty swarm's garbage peers start.
    clean = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    dirty = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    clean.start_bootstrap()
    dirty.start_bootstrap()
    peers = [clean.start_peer(0), clean.start_peer(1)]
    good = [dirty.start_peer(0), dirty.start_peer(1)]
    clean.wait_online(peers)
    clean_trainer = clean.start_trainer(*TRAIN_ARGS, "--routing", routing, "--report", str(tmp_path / "clean.json"))
    dirty.wait_online(good)
    # Started after the good ones, so they load the same initial state; every answer is garbage.
    nan_peer = dirty.start_peer(1, *fault_args(garbage="nan"), "--no-load-state")
    shape_peer = dirty.start_peer(1, *fault_args(garbage="shape"), "--no-load-state")
    clean_report = finish(clean_trainer, tmp_path / "clean.json")
    clean.stop()
    dirty.wait_online([nan_peer, shape_peer])
    report = finish(
        dirty.start_trainer(*TRAIN_ARGS, "--routing", routing, "--report", str(tmp_path / "dirty.json")),
        tmp_path / "dirty.json",
    )

    assert report["completed"] and report["microbatches_lost"] == 0
    # hub: the trainer read each garbage answer; direct: each garbage replica was tried (new replicas
    # are tried soon) and the peer before it failed over, saying how
    assert report["failures_by_kind"].get("garbage", 0) >= 2, report["failures_by_kind"]
    failed_calls = {peer_id[-8:]: c["calls_failed"] for peer_id, c in report["contributions"].items()}
    for bad in (nan_peer, shape_peer):
        assert report["calls_by_peer"].get(peer_key(bad), 0) == 0, report["calls_by_peer"]
        assert failed_calls.get(peer_key(bad), 0) >= 1, report["contributions"]  # as `swarm status` shows it
        assert bad.alive  # the trainer bans it; nobody crashes
    # The good replica computed every microbatch exactly once, as in the clean run: same losses, up
    # to the order in which concurrent microbatches were accumulated.
    for step, (clean_loss, loss) in enumerate(zip(clean_report["losses"], report["losses"])):
        assert abs(clean_loss - loss) <= 0.02 * clean_loss, (step, clean_report["losses"], report["losses"])
