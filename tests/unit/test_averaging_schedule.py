"""When periodic averaging meets (peers/replicas/averaging_schedule.py) and how the peer's flags choose it."""

from __future__ import annotations

import pytest

from peers.config import PeerConfig
from peers.replicas.averaging_schedule import AveragingSchedule
from process.config import ConfigError, from_sources


def test_by_steps_a_round_follows_every_kth_step_and_no_other():
    every_2 = AveragingSchedule(every_steps=2)
    assert [s for s in range(0, 9) if every_2.due_after_step(s)] == [2, 4, 6, 8]
    every_1 = AveragingSchedule(every_steps=1)
    assert [s for s in range(0, 4) if every_1.due_after_step(s)] == [1, 2, 3]  # never before the first step
    assert every_2.by_steps and every_2.describe() == "every 2 local steps"


def test_by_time_every_replica_picks_the_same_next_multiple_of_the_period():
    every_5s = AveragingSchedule(period_s=5.0)
    assert every_5s.next_round_time(1000.0) == 1005.0  # a round exactly now has begun: the next one
    assert every_5s.next_round_time(1003.9) == every_5s.next_round_time(1001.2) == 1005.0
    assert not every_5s.by_steps and not every_5s.due_after_step(5)
    with pytest.raises(ValueError, match="counts steps"):
        AveragingSchedule(every_steps=3).next_round_time(1000.0)


@pytest.mark.parametrize("kwargs", [{}, {"period_s": 5.0, "every_steps": 2}, {"period_s": 0.0}, {"every_steps": 0}])
def test_a_schedule_needs_exactly_one_positive_driver(kwargs):
    with pytest.raises(ValueError):
        AveragingSchedule(**kwargs)


def peer_config(**options) -> PeerConfig:
    """A PeerConfig as the flags named by `options` (leaf names, whatever their section) make it."""
    return from_sources(PeerConfig, env={}, stage=0, **options)


def test_the_peer_flags_pick_one_schedule():
    assert peer_config(averaging="periodic").replicas.schedule == AveragingSchedule(period_s=30.0)
    assert peer_config(averaging="periodic", averaging_period_s=5).replicas.schedule.period_s == 5
    by_steps = peer_config(averaging="periodic", averaging_every_steps=2).replicas
    assert by_steps.schedule == AveragingSchedule(every_steps=2) and by_steps.averaging_period_s is None


def test_the_delay_begins_after_the_warmup_unless_told_otherwise():
    assert peer_config(averaging="sync", sync_delay=1, warmup_steps=10).exact_steps_before_delay == 10
    assert peer_config(averaging="sync", sync_delay=1, warmup_steps=10, sync_delay_from=0).exact_steps_before_delay == 0
    assert peer_config(averaging="sync", sync_delay=1, sync_delay_from=3).exact_steps_before_delay == 3
    assert peer_config(averaging="sync", sync_delay=1).exact_steps_before_delay == 0  # no warmup: from the first
    assert peer_config(averaging="sync", warmup_steps=10).exact_steps_before_delay == 0  # no delay at all


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"averaging": "periodic", "averaging_every_steps": 2, "averaging_period_s": 5.0}, "give one"),
        ({"averaging": "sync", "averaging_every_steps": 2}, "use it with --averaging periodic"),
        ({"averaging": "periodic", "averaging_every_steps": 0}, "at least 1"),
        ({"averaging": "periodic", "averaging_period_s": -1.0}, "must be positive"),
        ({"averaging": "sync", "sync_delay_from": 5}, "use it with --sync-delay 1"),
        ({"averaging": "sync", "sync_delay": 1, "sync_delay_from": -1}, "0 .* or more"),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as error:
        peer_config(**kwargs)
    assert "\n" not in str(error.value)
