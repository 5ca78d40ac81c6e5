"""When a standby downloads its stage's state again, and what it says when taking over from its copy."""

import pytest

from dht.records import PeerRecord, PeerState
from peers.config import PlacementSettings
from peers.placement.standby_copy import announced_steps, copy_refresh_due, fallback_warning
from process.config import ConfigError


def record(peer_id: str, stage: int, steps: int, state: str = "online") -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        model="tiny",
        stage=stage,
        num_stages=2,
        state=PeerState(state),
        throughput=1.0,
        expires_at=100.0,
        steps_done=steps,
    )


def test_the_stage_has_done_what_its_most_advanced_online_replica_announced():
    records = [record("a", 1, 7), record("b", 1, 9), record("c", 1, 30, "offline"), record("d", 0, 40)]
    assert announced_steps(records, 1, 2) == 9
    assert announced_steps(records, 1, 3) is None  # another split
    assert announced_steps([record("c", 1, 30, "offline")], 1, 2) is None


def test_an_old_record_without_steps_reads_as_zero():
    wire = record("a", 1, 5).to_wire()
    del wire["steps_done"]
    assert PeerRecord.from_wire(wire).steps_done == 0


@pytest.mark.parametrize(
    ("copy_steps", "stage_steps", "since_attempt_s", "due"),
    [
        (0, None, None, True),  # never downloaded: at once
        (5, 9, 12.0, True),  # behind, and the replica will answer again
        (5, 9, 3.0, False),  # behind, but asked too recently (the replica would refuse)
        (9, 9, 60.0, False),  # up to date: an idle stage costs no download
        (5, None, 60.0, False),  # no online replica to ask
    ],
)
def test_a_standby_downloads_again_only_when_behind_and_allowed(copy_steps, stage_steps, since_attempt_s, due):
    assert (
        copy_refresh_due(
            copy_steps=copy_steps, stage_steps=stage_steps, since_attempt_s=since_attempt_s, min_interval_s=10.0
        )
        is due
    )


def test_the_fallback_warning_says_how_many_steps_old_the_copy_is():
    line = fallback_warning(
        stage=1, reason="it has no online replica", copy_steps=40, stage_steps=43, refreshed_s_ago=12.4
    )
    assert "from its own copy, 3 steps old (40 steps done, downloaded 12 s ago" in line
    assert "those steps are lost" in line
    fresh = fallback_warning(stage=1, reason="r", copy_steps=43, stage_steps=43, refreshed_s_ago=None)
    assert "0 steps old" in fresh and "never downloaded" in fresh and "lost" not in fresh


def test_a_refresh_period_below_what_replicas_answer_is_refused():
    with pytest.raises(ConfigError, match="at least 10"):
        PlacementSettings(standby_refresh_s=2.0)
    assert PlacementSettings(standby_refresh_s=10.0).standby_refresh_s == 10.0
