"""One record of another model cannot lock a stage (issue #60): a stranger announces itself on stage
0's key with another model fingerprint (and vocabulary), and claims another split before anyone.
Before, every new trainer exited (rc 2, "differs from the one") and new peers refused to start, in a
private run too. Now the record is skipped, counted, with a warning, the swarm's own model stays the
swarm's model, and in a run only the members' split claims count."""

from __future__ import annotations

import asyncio
import json

import pytest
from hivemind.utils import get_dht_time

from dht.announce import announce
from dht.node import NetworkConfig, start_dht
from dht.records import PeerRecord, PeerState, SplitRecord
from dht.split_agreement import publish_split

pytestmark = pytest.mark.slow

TRAIN_ARGS = ["--steps", "1", "--batch-size", "4", "--microbatch-size", "2", "--num-stages", "2"]


@pytest.mark.parametrize("run_kind", ["default", "private"])  # default: the local swarm's open run
def test_a_strangers_record_of_another_model_locks_no_stage(make_swarm, tmp_path, run_kind):
    from tests.integration.test_run_authority import Run

    run = Run(tmp_path, private=True) if run_kind == "private" else None

    def args(name: str, role: str, stage: int | None = None) -> list[str]:
        return run.args(name, role, stage) if run is not None else []

    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    peers = [swarm.start_peer(stage, *args(f"s{stage}", "peer", stage)) for stage in range(2)]
    swarm.wait_online(peers)

    stranger = start_dht(NetworkConfig(initial_peers=swarm.initial_peers))
    try:
        record = PeerRecord(
            peer_id=stranger.peer_id.to_base58(),
            model="tiny",
            stage=0,
            num_stages=2,
            state=PeerState.ONLINE,
            throughput=1e6,
            model_hash="f" * 16,
            vocab_size=7,  # another vocabulary too: refused alike before
            expires_at=get_dht_time() + 600,
        )
        assert asyncio.run(announce(stranger, record))
        # ...and claims another split, earlier than anyone (the earliest claim is the swarm's)
        now = get_dht_time()
        split = SplitRecord(
            peer_id=record.peer_id, model="tiny", num_stages=2, boundaries=(0, 2, 3), since=0.0, expires_at=now + 600
        )
        assert publish_split(stranger, split)

        joiner = swarm.start_peer(1, *args("joiner", "peer", 1), name="peer-joiner")
        report_path = tmp_path / "report.json"
        trainer = swarm.start_trainer(*TRAIN_ARGS, "--report", str(report_path), *args("trainer", "trainer"))
        assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
        report = json.loads(report_path.read_text())
        assert report["completed"] and report["foreign_peers_skipped"] == 1, report
        assert "announce another model (hash ffffffffffffffff" in trainer.log()
        assert stranger.peer_id.to_base58()[-8:] not in report["calls_by_peer"]
        swarm.wait_online([joiner])
        assert "skipping 1 record(s) of 1 peer(s) that announce another model" in joiner.log(), joiner.log()[-3000:]
    finally:
        stranger.shutdown()
