"""benchmarks/churn.py's analysis: stall, recovery and capacity from a series of step completions."""

import pytest

from benchmarks.churn import SCHEDULE, align_clock, analyse, rate_between, rate_series, recovery_after, stall_after

TOKENS = 100  # per step


def steady(start_s: float, end_s: float, every_s: float) -> list[float]:
    """Step completions every `every_s` seconds in (start_s, end_s]."""
    n = int(round((end_s - start_s) / every_s))
    return [start_s + every_s * (i + 1) for i in range(n)]


def test_rate_counts_steps_completed_inside_the_interval():
    steps = steady(0.0, 10.0, 0.5)  # 2 steps/s
    assert rate_between(steps, TOKENS, 0.0, 10.0) == pytest.approx(200.0)
    assert rate_between(steps, TOKENS, 2.0, 3.0) == pytest.approx(200.0)  # (2, 3] holds 2.5 and 3.0
    with pytest.raises(ValueError):
        rate_between(steps, TOKENS, 3.0, 3.0)
    assert [rate for _, rate in rate_series(steps, TOKENS, 0.0, 4.0)] == [200.0] * 4


def test_stall_is_the_longest_gap_from_the_kill_on():
    steps = steady(0.0, 20.0, 1.0) + [27.0] + steady(27.0, 40.0, 1.0)  # nothing between 20 and 27
    assert stall_after(steps, 19.5, horizon_s=15.0) == pytest.approx(7.0)
    assert stall_after(steps, 22.0, horizon_s=15.0) == pytest.approx(5.0)  # from the kill, not the last step
    assert stall_after(steady(0.0, 40.0, 1.0), 10.0, horizon_s=15.0) == pytest.approx(1.0)
    assert stall_after([1.0, 2.0], 5.0, horizon_s=15.0) == pytest.approx(15.0)  # never resumed


def test_recovery_is_the_end_of_the_first_window_back_at_90_percent():
    before = steady(0.0, 20.0, 0.5)  # 200 tokens/s with the full set
    stalled = [26.0]  # a 6 s stall after a kill at 20 s
    after = steady(26.0, 60.0, 0.5 * 1.0 / 0.95)  # the survivors: 95% of their capacity of 200
    steps = before + stalled + after
    recovery_s = recovery_after(steps, TOKENS, 20.0, 200.0, window_s=5.0, horizon_s=40.0)
    # the first 5 s window at >= 180 tokens/s cannot end before the stall does (6 s after the kill)
    # plus most of a window; it ends at the latest 6 + 5 s after the kill
    assert 10.0 <= recovery_s <= 11.0
    slower = before + stalled + steady(26.0, 60.0, 1.0)  # only 100 tokens/s: never back to 90% of 200
    assert recovery_after(slower, TOKENS, 20.0, 200.0, window_s=5.0, horizon_s=40.0) is None
    assert recovery_after(slower, TOKENS, 20.0, 100.0, window_s=5.0, horizon_s=40.0) is not None


def test_clock_alignment_takes_the_smallest_observed_delay():
    step_end_s = [1.0, 2.0, 3.0]  # the trainer's clock
    observations = [(1, 11.3), (2, 12.05), (3, 13.2)]  # this script saw them 10 s later, plus polling delay
    assert align_clock(observations, step_end_s) == pytest.approx(10.05)
    with pytest.raises(ValueError):
        align_clock([(5, 1.0)], step_end_s)


def test_analyse_judges_each_kill_against_the_steady_rate_of_its_reference_phase():
    phase_s = 40.0
    starts = {phase.name: i * phase_s for i, phase in enumerate(SCHEDULE)}
    rates = {"A": 2.0, "B": 2.0, "C": 3.0, "D": 2.0, "E": 2.0}  # steps/s
    steps = []
    for phase in SCHEDULE:
        start = starts[phase.name]
        gap_s = 4.0 if phase.action == "kill" else 0.0  # each kill stalls the swarm for 4 s
        steps += steady(start + gap_s, start + phase_s, 1.0 / rates[phase.name])
    result = analyse(steps, TOKENS, starts, len(SCHEDULE) * phase_s, settle_s=10.0, window_s=5.0, horizon_s=40.0)
    assert result["phases"]["C"]["steady_tokens_per_s"] == pytest.approx(300.0, rel=0.05)
    kills = {kill["phase"]: kill for kill in result["kills"]}
    assert set(kills) == {"D", "E"}
    assert kills["D"]["capacity_measured_in"] == "B"
    assert kills["D"]["surviving_capacity_tokens_per_s"] == pytest.approx(200.0, rel=0.05)
    assert kills["D"]["stall_s"] == pytest.approx(4.5, abs=0.01)  # 4 s, then the first step half a second later
    assert kills["D"]["recovery_s"] == pytest.approx(9.0, abs=0.6)
    assert kills["D"]["goal_stall_met"] and kills["D"]["goal_recovery_met"]
