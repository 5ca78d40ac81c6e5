"""ReplicaScheduler: interleaved weighted round-robin over the replicas of one stage."""

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.trainer.routing import ReplicaInfo, ReplicaScheduler


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_scheduler(throughputs: dict[str, float], **kwargs) -> ReplicaScheduler:
    scheduler = ReplicaScheduler(clock=kwargs.pop("clock", FakeClock()), **kwargs)
    scheduler.update_replicas([ReplicaInfo(p, t) for p, t in throughputs.items()])
    return scheduler


def pick_shares(scheduler: ReplicaScheduler, picks: int, task="forward", samples=1) -> dict:
    counts = Counter(scheduler.choose(task, samples) for _ in range(picks))
    return {peer_id: count / picks for peer_id, count in counts.items()}


def serve(scheduler, true_throughputs, picks, task="forward", samples=4) -> Counter:
    """Route `picks` tasks and report each as taking the time its peer really needs."""
    counts = Counter()
    for _ in range(picks):
        peer_id = scheduler.choose(task, samples)
        cost = 2.5 if task == "backward" else 1.0
        scheduler.report_success(peer_id, task, samples, samples * cost / true_throughputs[peer_id])
        counts[peer_id] += 1
    return counts


def test_shares_follow_announced_throughputs_3_to_1():
    scheduler = make_scheduler({"a": 3.0, "b": 1.0}, prior_spread=math.inf)
    shares = pick_shares(scheduler, 4000)
    assert shares["a"] == pytest.approx(0.75, abs=0.02)
    assert shares["b"] == pytest.approx(0.25, abs=0.02)
    assert scheduler.shares() == pytest.approx({"a": 0.75, "b": 0.25})


def test_picks_are_interleaved_not_bursty():
    scheduler = make_scheduler({"a": 3.0, "b": 1.0}, prior_spread=math.inf)
    picks = [scheduler.choose("forward", 1) for _ in range(40)]
    # Every window of 4 consecutive picks contains exactly one pick of the slow replica.
    assert all(picks[i : i + 4].count("b") == 1 for i in range(0, 40, 4))


def test_work_shares_hold_for_mixed_forward_and_backward_tasks():
    scheduler = make_scheduler({"a": 3.0, "b": 1.0}, prior_spread=math.inf)
    work = Counter()
    for i in range(4000):
        task, samples = ("backward", 2) if i % 3 == 0 else ("forward", 5)
        work[scheduler.choose(task, samples)] += samples * (2.5 if task == "backward" else 1.0)
    total = sum(work.values())
    assert work["a"] / total == pytest.approx(0.75, abs=0.02)


def test_backward_task_is_charged_backward_cost_times_a_forward():
    scheduler = make_scheduler({"a": 2.0})
    scheduler.choose("backward", 4)
    assert scheduler.keys_s() == {"a": pytest.approx(4 * 2.5 / 2.0)}


def test_backward_goes_back_to_the_replica_that_cached_its_forward_and_is_charged_no_recompute():
    scheduler = make_scheduler({"a": 2.0, "b": 2.0})
    assert scheduler.choose("forward", 4) == "a"  # a now holds the activations; b is the least busy
    assert scheduler.choose("backward", 4, cached_on="a") == "a"
    # a: the forward (4 / 2.0 s) plus a backward without recompute ((2.5 - 1) * 4 / 2.0 s).
    assert scheduler.keys_s()["a"] == pytest.approx(4 / 2.0 + 1.5 * 4 / 2.0)


def test_backward_goes_elsewhere_when_the_caching_replica_would_finish_it_later():
    scheduler = make_scheduler({"a": 1.0, "b": 4.0}, prior_spread=math.inf)
    assert scheduler.choose("forward", 4) == "a"  # a is 4 s busy, b idle
    # On b the backward (recompute included) ends after 2.5 s; on a after 4 + 6 s.
    assert scheduler.choose("backward", 4, cached_on="a") == "b"
    assert scheduler.keys_s()["b"] == pytest.approx(2.5 * 4 / 4.0)


def test_backward_never_goes_to_an_excluded_or_unknown_caching_replica():
    scheduler = make_scheduler({"a": 2.0, "b": 2.0})
    scheduler.choose("forward", 4)
    assert scheduler.choose("backward", 4, cached_on="a", exclude={"a"}) == "b"
    assert scheduler.choose("backward", 4, cached_on="gone") in {"a", "b"}


def test_a_cached_backward_is_measured_as_one_forward_less():
    scheduler = make_scheduler({"a": 1.0})
    scheduler.choose("backward", 4, cached_on="a")
    scheduler.report_success("a", "backward_cached", 4, 4 * 1.5 / 8.0)  # a really does 8 samples/s
    assert scheduler.throughputs() == {"a": pytest.approx(8.0)}


def test_measured_throughput_overrides_a_wrong_announcement():
    scheduler = make_scheduler({"a": 1.0, "b": 1.0})  # both claim the same speed
    true_throughputs = {"a": 30.0, "b": 10.0}  # but a is 3x faster
    serve(scheduler, true_throughputs, picks=500)
    counts = serve(scheduler, true_throughputs, picks=4000)
    assert counts["a"] / 4000 == pytest.approx(0.75, abs=0.02)
    assert scheduler.throughputs() == pytest.approx(true_throughputs, rel=1e-3)


def test_replica_slowed_3x_gets_a_third_of_its_partners_share():
    scheduler = make_scheduler({"a": 10.0, "b": 10.0})
    serve(scheduler, {"a": 10.0, "b": 10.0}, picks=200)
    slowed = {"a": 10.0, "b": 10.0 / 3}
    serve(scheduler, slowed, picks=500, task="backward")  # the EMA catches up
    counts = serve(scheduler, slowed, picks=4000, task="backward")
    assert counts["b"] / counts["a"] == pytest.approx(1 / 3, abs=0.03)


def test_new_peer_gets_picks_soon_but_is_not_flooded():
    scheduler = make_scheduler({"a": 1.0, "b": 1.0})
    pick_shares(scheduler, 1001)  # keys of a and b are now far from where they started
    scheduler.update_replicas([ReplicaInfo(p, 1.0) for p in ("a", "b", "c")])
    picks = [scheduler.choose("forward", 1) for _ in range(300)]
    assert "c" in picks[:3]
    assert picks[:30].count("c") <= 11
    assert picks.count("c") / 300 == pytest.approx(1 / 3, abs=0.02)


def test_peer_back_from_exclusion_resumes_at_the_frontier():
    scheduler = make_scheduler({"a": 1.0, "b": 1.0})
    for _ in range(500):
        assert scheduler.choose("forward", 1, exclude={"b"}) == "a"
    picks = [scheduler.choose("forward", 1) for _ in range(20)]
    assert picks.count("b") <= 11  # no catch-up burst for the time b sat out


def test_exclude_is_respected_and_none_when_everyone_is_excluded():
    scheduler = make_scheduler({"a": 3.0, "b": 1.0, "c": 1.0})
    for _ in range(50):
        assert scheduler.choose("forward", 2, exclude=["a", "c"]) == "b"
    assert scheduler.choose("forward", 2, exclude={"a", "b", "c"}) is None
    assert ReplicaScheduler().choose("forward", 1) is None


def test_removed_peers_are_never_chosen_and_forget_their_history():
    scheduler = make_scheduler({"a": 1.0, "b": 1.0, "c": 1.0})
    pick_shares(scheduler, 10)
    scheduler.update_replicas([ReplicaInfo("a", 1.0), ReplicaInfo("c", 1.0)])
    assert set(pick_shares(scheduler, 100)) == {"a", "c"}
    assert set(scheduler.throughputs()) == {"a", "c"}
    scheduler.report_success("b", "forward", 1, 0.5)  # late report from a departed peer
    assert set(scheduler.throughputs()) == {"a", "c"}


def test_same_calls_give_the_same_choices_with_ties_broken_by_peer_id():
    def run() -> list:
        scheduler = make_scheduler({"c": 1.0, "b": 1.0, "a": 1.0})
        return [scheduler.choose("forward", 1 + i % 3) for i in range(200)]

    first = run()
    assert first[:3] == ["a", "b", "c"]
    assert run() == first


def test_keys_stay_bounded_over_many_picks():
    scheduler = make_scheduler({"a": 5.0, "b": 1.0, "c": 0.5})
    for i in range(20000):
        scheduler.choose("backward" if i % 2 else "forward", 8, exclude={"c"} if i % 7 else ())
    largest_task_s = 8 * 2.5 / 0.5
    assert max(scheduler.keys_s().values()) <= largest_task_s
    assert min(scheduler.keys_s().values()) >= 0.0


def test_unknown_announced_throughput_falls_back_to_the_default():
    scheduler = make_scheduler(
        {"zero": 0.0, "neg": -3.0, "nan": float("nan"), "inf": float("inf"), "none": None},
        default_throughput=2.0,
    )
    assert scheduler.throughputs() == pytest.approx(dict.fromkeys(scheduler.throughputs(), 2.0))


def test_announcement_is_used_only_until_the_peer_is_measured():
    scheduler = make_scheduler({"a": 1.0})
    scheduler.update_replicas([ReplicaInfo("a", 4.0)])
    assert scheduler.throughputs()["a"] == pytest.approx(4.0)
    scheduler.choose("forward", 2)
    scheduler.report_success("a", "forward", 2, elapsed_s=1.0)  # measured 2 samples/s
    scheduler.update_replicas([ReplicaInfo("a", 100.0)])
    assert scheduler.throughputs()["a"] == pytest.approx(2.0)  # the first measurement replaces the prior


def test_measurements_are_a_plain_mean_until_one_over_alpha_then_an_ema():
    scheduler = make_scheduler({"a": 1.0}, ema_alpha=0.25)
    for elapsed_s in (1.0, 2.0, 3.0, 4.0):  # 1, 2, 3, 4 seconds per sample
        scheduler.choose("forward", 1)
        scheduler.report_success("a", "forward", 1, elapsed_s)
    assert scheduler.throughputs()["a"] == pytest.approx(1 / 2.5)  # mean of the four
    scheduler.choose("forward", 1)
    scheduler.report_success("a", "forward", 1, 10.0)  # 5th: weight alpha, not 1/5
    assert scheduler.throughputs()["a"] == pytest.approx(1 / (0.25 * 10.0 + 0.75 * 2.5))


def test_a_wrong_prior_does_not_decide_a_short_runs_shares():
    # The slowed replica announced 0.45x its partner (a start-up benchmark under load) but is
    # really 3x slower; it gets only a handful of calls, which must be enough to correct it.
    scheduler = make_scheduler({"fast": 2.0, "slow": 0.9})
    counts = serve(scheduler, {"fast": 2.0, "slow": 2.0 / 3}, picks=48, task="backward", samples=2)
    assert counts["slow"] / counts["fast"] == pytest.approx(1 / 3, rel=0.2), counts


def test_immediate_failure_gives_the_charge_back():
    clock = FakeClock()
    scheduler = make_scheduler({"a": 1.0, "b": 1.0}, clock=clock)
    assert scheduler.choose("forward", 10) == "a"
    scheduler.report_failure("a")  # refused at once: a did no work
    assert scheduler.keys_s()["a"] == 0.0
    assert scheduler.choose("forward", 10, exclude={"a"}) == "b"  # the retry
    assert scheduler.choose("forward", 10) == "a"  # a is not charged for the failed task


def test_timed_out_failure_keeps_the_time_the_peer_was_tied_up():
    clock = FakeClock()
    scheduler = make_scheduler({"a": 1.0, "b": 1.0}, clock=clock)
    scheduler.choose("forward", 10)  # expected to keep a busy for 10 s
    clock.now_s += 4.0
    scheduler.report_failure("a")
    assert scheduler.keys_s()["a"] == pytest.approx(4.0)
    clock.now_s += 100.0
    scheduler.report_failure("a")  # nothing pending any more: no change
    assert scheduler.keys_s()["a"] == pytest.approx(4.0)


def test_a_call_made_again_to_the_same_replica_settles_its_own_charge():
    clock = FakeClock()
    scheduler = make_scheduler({"a": 1.0, "b": 1.0}, clock=clock)
    assert scheduler.choose("backward", 4, exclude={"b"}) == "a"  # microbatch 1: its answer is lost
    assert scheduler.choose("backward", 4, exclude={"b"}) == "a"  # microbatch 2, still pending
    scheduler.report_failure("a")
    assert scheduler.charge("a", "backward", 4)  # microbatch 1 asked of a again
    scheduler.report_success("a", "backward", 4, 0.0)
    # microbatch 2's charge is still pending: its failure settles it (an uncharged repeat would
    # have settled it early, and this failure would find nothing to settle)
    keys = scheduler.keys_s()["a"]
    scheduler.report_failure("a")
    assert scheduler.keys_s()["a"] == pytest.approx(keys - 4 * 2.5)
    assert not scheduler.charge("gone", "backward", 4) and "gone" not in scheduler.keys_s()


def test_failure_does_not_change_throughput():
    scheduler = make_scheduler({"a": 3.0})
    scheduler.choose("forward", 1)
    scheduler.report_failure("a")
    assert scheduler.throughputs() == {"a": pytest.approx(3.0)}


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.choose("sideways", 1),
        lambda s: s.choose("forward", 0),
        lambda s: s.choose("forward", 1.5),
        lambda s: s.report_success("a", "forward", 1, -1.0),
        lambda s: s.report_success("a", "forward", 1, float("nan")),
        lambda s: ReplicaScheduler(ema_alpha=0.0),
        lambda s: ReplicaScheduler(backward_cost=-1.0),
        lambda s: ReplicaScheduler(default_throughput=0.0),
    ],
)
def test_invalid_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call(make_scheduler({"a": 1.0}))


PEERS = ["p0", "p1", "p2", "p3", "p4"]
throughput_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(0.0),
    st.none(),
    st.floats(min_value=1e-3, max_value=1e3),
)
operations = st.one_of(
    st.tuples(
        st.just("update"),
        st.dictionaries(st.sampled_from(PEERS), throughput_values, max_size=len(PEERS)),
    ),
    st.tuples(
        st.just("choose"),
        st.sampled_from(["forward", "backward"]),
        st.integers(1, 10_000),
        st.sets(st.sampled_from(PEERS)),
        st.one_of(st.none(), st.sampled_from(PEERS)),
    ),
    st.tuples(
        st.just("success"),
        st.sampled_from(PEERS),
        st.sampled_from(["forward", "backward", "backward_cached"]),
        st.integers(1, 10_000),
        st.floats(min_value=0.0, max_value=1e6),
    ),
    st.tuples(st.just("failure"), st.sampled_from(PEERS)),
    st.tuples(st.just("tick"), st.floats(min_value=0.0, max_value=1e4)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operations, max_size=60))
def test_random_call_sequences_never_raise_nor_leave_the_current_set(ops):
    clock = FakeClock()
    scheduler = ReplicaScheduler(clock=clock)
    current: set[str] = set()
    for op in ops:
        if op[0] == "update":
            scheduler.update_replicas([ReplicaInfo(p, t) for p, t in op[1].items()])
            current = set(op[1])
        elif op[0] == "choose":
            _, task, samples, exclude, cached_on = op
            chosen = scheduler.choose(task, samples, exclude=exclude, cached_on=cached_on)
            if current - exclude:
                assert chosen in current - exclude
            else:
                assert chosen is None
        elif op[0] == "success":
            scheduler.report_success(op[1], op[2], op[3], op[4])
        elif op[0] == "failure":
            scheduler.report_failure(op[1])
        else:
            clock.now_s += op[1]
        keys_s = scheduler.keys_s()
        throughputs = scheduler.throughputs()
        assert set(keys_s) == set(throughputs) == current
        assert all(0.0 <= k < float("inf") for k in keys_s.values())
        assert all(0.0 < t < float("inf") for t in throughputs.values())
        if current:
            assert sum(scheduler.shares().values()) == pytest.approx(1.0)


def test_an_unmeasured_replica_is_believed_no_faster_than_a_measured_one_or_twice_the_slowest():
    """Issue #60: a replica announcing 1000x its partner drew 239 of 240 chains under direct routing,
    where the trainer times nothing but whole chains."""
    scheduler = make_scheduler({"honest": 10.0, "liar": 10_000.0})
    assert scheduler.throughputs() == pytest.approx({"honest": 10.0, "liar": 20.0})  # PRIOR_SPREAD x the slowest
    assert make_scheduler({"a": 10.0, "b": 15.0}).throughputs() == pytest.approx({"a": 10.0, "b": 15.0})
    scheduler.choose("forward", 2)
    scheduler.report_success("honest", "forward", 2, elapsed_s=0.4)  # measured: 5 samples/s
    scheduler.update_replicas([ReplicaInfo("honest", 10.0), ReplicaInfo("liar", 10_000.0), ReplicaInfo("new", 1e9)])
    assert scheduler.throughputs() == pytest.approx({"honest": 5.0, "liar": 5.0, "new": 5.0})
    with pytest.raises(ValueError):
        ReplicaScheduler(prior_spread=0.5)
