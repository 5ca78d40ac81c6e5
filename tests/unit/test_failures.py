"""TimeoutPolicy, BanList, and the errors the trainer raises when it gives up; with the retry budget of
wire/call_rules.py, the pieces together as the trainer's loop uses them."""

import pytest

from swarm.trainer.failures import (
    BanList,
    RetriesExhaustedError,
    RoutingError,
    StageUnavailableError,
    TimeoutPolicy,
)
from swarm.trainer.routing import ReplicaInfo, ReplicaScheduler
from wire.call_rules import Attempts
from wire.failures import Failure


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


# TimeoutPolicy


def test_timeout_is_initial_until_enough_latencies_are_observed():
    policy = TimeoutPolicy()
    for _ in range(4):
        policy.observe(0, "forward", 1.0)
        assert policy.timeout_s(0, "forward") == 60.0
    policy.observe(0, "forward", 1.0)
    assert policy.timeout_s(0, "forward") == 5.0  # 1 s * 3 is under the floor


def test_timeout_is_a_margin_over_the_95th_percentile():
    policy = TimeoutPolicy()
    for latency_s in range(1, 21):  # 1..20 s
        policy.observe(1, "backward", float(latency_s))
    # Linear interpolation: position 0.95 * 19 = 18.05 -> 19.05 s; times margin 3.
    assert policy.timeout_s(1, "backward") == pytest.approx(19.05 * 3.0)


def test_timeout_is_clamped_to_floor_and_cap():
    policy = TimeoutPolicy(floor_s=2.0, cap_s=30.0)
    for _ in range(5):
        policy.observe(0, "forward", 0.01)
        policy.observe(0, "backward", 50.0)
    assert policy.timeout_s(0, "forward") == 2.0
    assert policy.timeout_s(0, "backward") == 30.0


def test_timeout_follows_the_recent_window_and_is_kept_per_stage_and_task():
    policy = TimeoutPolicy(window=10)
    for _ in range(10):
        policy.observe(0, "forward", 30.0)
    for _ in range(10):
        policy.observe(0, "forward", 4.0)  # the peers got faster; old latencies fall out
    assert policy.timeout_s(0, "forward") == pytest.approx(12.0)
    assert policy.timeout_s(0, "backward") == 60.0
    assert policy.timeout_s(1, "forward") == 60.0


def test_probation_is_the_timeout_without_its_floor_from_the_first_answer_on():
    policy = TimeoutPolicy()
    assert policy.probation_s(1, "forward") is None  # nothing answered yet: nothing to compare with
    policy.observe(1, "forward", 0.2)
    policy.observe(1, "forward", 0.5)
    assert policy.probation_s(1, "forward") == pytest.approx(1.5)  # the largest of the few, times 3
    for _ in range(38):
        policy.observe(1, "forward", 0.1)
    assert policy.probation_s(1, "forward") == 0.5  # 3 x the 95th percentile (0.3 s), under its floor
    assert policy.timeout_s(1, "forward") == 5.0  # the timeout's own floor is higher
    for _ in range(100):
        policy.observe(1, "forward", 100.0)
    assert policy.probation_s(1, "forward") == policy.timeout_s(1, "forward") == 120.0  # both capped


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_timeout_rejects_impossible_latencies(seconds):
    with pytest.raises(ValueError):
        TimeoutPolicy().observe(0, "forward", seconds)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantile": 1.5},
        {"margin": 0.0},
        {"floor_s": 10.0, "cap_s": 5.0},
        {"min_observations": 0},
        {"probation_floor_s": 0.0},
    ],
)
def test_timeout_policy_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        TimeoutPolicy(**kwargs)


# BanList


def test_ban_doubles_per_consecutive_failure_up_to_the_cap():
    clock = FakeClock()
    bans = BanList(clock=clock)
    durations_s = []
    for _ in range(7):
        durations_s.append(bans.ban("p"))
        clock.now_s += durations_s[-1]  # wait it out, then fail again
    assert durations_s == [15.0, 30.0, 60.0, 120.0, 240.0, 300.0, 300.0]


def test_a_slow_failure_is_banned_at_least_as_long_as_asked_a_fast_one_backs_off_from_the_base():
    clock = FakeClock()
    bans = BanList(base_s=1.0, max_s=60.0, clock=clock)
    assert bans.ban("refused") == 1.0  # refused at once: cheap to try again soon
    assert bans.ban("timed-out", at_least_s=15.0) == 15.0  # took a whole timeout: not soon
    assert bans.ban("huge", at_least_s=1e9) == 60.0  # the cap still holds
    clock.now_s += 1.0
    assert bans.ban("refused") == 2.0  # backoff from the base as usual
    with pytest.raises(ValueError):
        bans.ban("p", at_least_s=float("nan"))


def test_ban_expires_with_the_clock():
    clock = FakeClock()
    bans = BanList(base_s=10.0, clock=clock)
    bans.ban("p")
    clock.now_s += 9.99
    assert bans.is_banned("p") and bans.banned() == {"p"}
    assert bans.seconds_until_next_unban() == pytest.approx(0.01)
    clock.now_s += 0.01
    assert not bans.is_banned("p") and bans.banned() == set()
    assert bans.seconds_until_next_unban() is None


def test_failures_during_a_ban_are_one_incident():
    clock = FakeClock()
    bans = BanList(clock=clock)
    assert bans.ban("p") == 15.0
    clock.now_s += 5.0
    assert bans.ban("p") == pytest.approx(10.0)  # an in-flight call failing too
    clock.now_s += 10.0
    assert not bans.is_banned("p")
    assert bans.ban("p") == 30.0  # the second incident, not the third


def test_clear_lifts_the_ban_and_resets_the_backoff():
    clock = FakeClock()
    bans = BanList(clock=clock)
    bans.ban("p")
    clock.now_s += 15.0
    bans.ban("p")
    bans.clear("p")
    assert not bans.is_banned("p")
    assert bans.ban("p") == 15.0


def test_backoff_never_overflows_for_a_peer_that_keeps_failing():
    clock = FakeClock()
    bans = BanList(base_s=1.0, max_s=1e6, forget_after_s=1e9, clock=clock)
    for _ in range(2000):
        clock.now_s += bans.ban("p")
    assert bans.ban("p") == 1e6


def test_failure_history_is_forgotten_long_after_the_ban():
    clock = FakeClock()
    bans = BanList(forget_after_s=600.0, clock=clock)
    bans.ban("p")
    clock.now_s += 15.0 + 599.0
    assert bans.ban("p") == 30.0
    clock.now_s += 30.0 + 600.0
    assert bans.ban("p") == 15.0


def test_bans_are_per_peer():
    clock = FakeClock()
    bans = BanList(clock=clock)
    bans.ban("a")
    clock.now_s += 20.0
    bans.ban("b")
    assert bans.banned() == {"b"}


# the budget's errors


def test_retries_exhausted_says_what_failed_and_what_to_do():
    attempts = Attempts(max_failures=2)
    for peer_id, reason in [("peer-a", "TimeoutError after 60.0 s"), ("peer-b", "ConnectionResetError")] * 2:
        attempts.failed(peer_id, Failure.TIMEOUT, reason)
    assert attempts.spent
    error = RetriesExhaustedError(2, attempts.failures[:3])
    assert isinstance(error, RoutingError) and isinstance(error, RuntimeError)
    assert error.stage == 2 and len(error.failures) == 3
    message = str(error)
    assert "stage 2" in message and "3 failed attempts" in message
    assert "peer-b: ConnectionResetError" in message and "max_retries" in message


def test_stage_unavailable_error_says_what_to_do():
    error = StageUnavailableError(1, "all 3 replicas are banned")
    assert isinstance(error, RoutingError)
    assert error.stage == 1 and error.reason == "all 3 replicas are banned"
    assert "stage 1" in str(error) and "Start a peer serving stage 1" in str(error)


# The pieces together, as the trainer's loop uses them (see the swarm.trainer.failures docstring).


def route_one_microbatch(scheduler, bans, timeouts, budget, call, stage=0, samples=4):
    task = "forward"
    while True:
        peer_id = scheduler.choose(task, samples, exclude=bans.banned() | budget.failed_peers())
        if peer_id is None:
            raise StageUnavailableError(stage, "every replica is banned or already failed")
        try:
            elapsed_s = call(peer_id, timeouts.timeout_s(stage, task))
        except TimeoutError as error:
            scheduler.report_failure(peer_id)
            bans.ban(peer_id)
            budget.failed(peer_id, Failure.TIMEOUT, repr(error))
            if budget.spent:
                raise RetriesExhaustedError(stage, budget.failures) from None
            continue
        timeouts.observe(stage, task, elapsed_s)
        scheduler.report_success(peer_id, task, samples, elapsed_s)
        bans.clear(peer_id)
        return peer_id


def test_microbatch_fails_over_to_a_healthy_replica_and_the_bad_one_is_banned():
    clock = FakeClock()
    scheduler = ReplicaScheduler(clock=clock)
    scheduler.update_replicas([ReplicaInfo("a", 10.0), ReplicaInfo("b", 10.0)])
    bans, timeouts = BanList(clock=clock), TimeoutPolicy()

    def call(peer_id, timeout_s):
        if peer_id == "a":
            clock.now_s += timeout_s
            raise TimeoutError(f"{peer_id} did not answer in {timeout_s} s")
        return 0.4

    served_by = [route_one_microbatch(scheduler, bans, timeouts, Attempts(max_failures=5), call) for _ in range(5)]
    assert served_by == ["b"] * 5
    assert bans.banned() == {"a"}


def test_microbatch_gives_up_loudly_when_every_replica_fails():
    clock = FakeClock()
    scheduler = ReplicaScheduler(clock=clock)
    scheduler.update_replicas([ReplicaInfo("a", 1.0), ReplicaInfo("b", 1.0)])

    def call(peer_id, timeout_s):
        raise TimeoutError(peer_id)

    with pytest.raises(StageUnavailableError):
        route_one_microbatch(scheduler, BanList(clock=clock), TimeoutPolicy(), Attempts(max_failures=5), call)
    # Without bans or exclusion of failed peers, the budget is what stops the loop.
    budget = Attempts(max_failures=3)
    for tries in range(1, 10):
        budget.failed(scheduler.choose("forward", 1), Failure.TIMEOUT, "TimeoutError")
        if budget.spent:
            break
    assert tries == 4 and budget.attempts_left == 0


def test_before_enough_latencies_a_call_waits_what_its_replica_is_expected_to_take_within_bounds():
    """Issue #60: three sybils that stall from their first call held a step for 280 s at a minute each."""
    policy = TimeoutPolicy()  # floor 5 s, initial 60 s, first_call_margin 20
    assert policy.timeout_s(0, "forward", expected_s=0.01) == 5.0  # a fast replica: the floor
    assert policy.timeout_s(0, "forward", expected_s=1.0) == 20.0
    assert policy.timeout_s(0, "forward", expected_s=100.0) == 60.0  # never longer than without an estimate
    assert policy.timeout_s(0, "forward", expected_s=None) == 60.0
    assert policy.timeout_s(0, "forward", expected_s=float("nan")) == 60.0
    for _ in range(5):
        policy.observe(0, "forward", 4.0)
    assert policy.timeout_s(0, "forward", expected_s=0.01) == 12.0  # then the latencies decide, as before
    with pytest.raises(ValueError):
        TimeoutPolicy(first_call_margin=0.0)


def test_a_peer_that_keeps_timing_out_is_banned_for_long_with_backoff():
    clock = FakeClock()
    bans = BanList(base_s=1.0, max_s=60.0, clock=clock)  # the trainer's (swarm/trainer/discovery.py)
    durations_s = []
    for _ in range(4):
        durations_s.append(bans.ban("sybil", at_least_s=15.0, timed_out=True))
        if len(durations_s) == 2:
            assert bans.stalled("sybil")
        clock.now_s += durations_s[-1]
    assert durations_s == [15.0, 300.0, 600.0, 1200.0]  # the second strike: a stall ban, doubling
    assert not bans.stalled("sybil")  # over, until it stalls again
    # an answer in between clears the strikes: an honest replica that timed out once now and then
    assert bans.ban("honest", at_least_s=15.0, timed_out=True) == 15.0
    clock.now_s += 15.0
    bans.clear("honest")
    assert bans.ban("honest", at_least_s=15.0, timed_out=True) == 15.0
    clock.now_s += 15.0
    assert bans.ban("refused-then-timeout") == 1.0 and not bans.stalled("refused-then-timeout")
    with pytest.raises(ValueError):
        BanList(stall_strikes=0)


def test_a_peer_that_never_answered_is_banned_for_long_at_its_first_timeout():
    clock = FakeClock()
    bans = BanList(base_s=1.0, max_s=60.0, clock=clock)
    assert bans.ban("sybil", at_least_s=15.0, timed_out=True, unproven=True) == 300.0 and bans.stalled("sybil")
    assert bans.ban("new", unproven=True) == 1.0  # not a timeout: a short ban, as any failure
