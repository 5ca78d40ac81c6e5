"""Pure rebalancing decisions: who moves, where, and never at the cost of an empty stage."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peers.placement.rebalance import (
    ReplicaView,
    choose_initial_stage,
    choose_standby_target,
    decide_move,
    decision_in_plan,
    loss_check_delay_s,
    next_check_delay_s,
    optimal_bottleneck,
    plan_rebalance,
    should_standby_take_over,
    stage_throughputs,
    stages_that_lost_replicas,
)
from peers.placement.stage_assignment import bottleneck_upper_bound, exact_bottleneck, greedy_bottleneck


def online(peer_id: str, stage: int, throughput: float = 1.0) -> ReplicaView:
    return ReplicaView(peer_id, stage, throughput, "online")


def movers(replicas, num_stages, **kwargs):
    decisions = {r.peer_id: decide_move(r.peer_id, replicas, num_stages, **kwargs) for r in replicas}
    return {pid: d for pid, d in decisions.items() if d.move}


def test_three_on_one_stage_one_on_the_other_exactly_one_moves():
    swarm = [online("c", 0), online("a", 0), online("b", 0), online("d", 1)]
    moved = movers(swarm, 2)
    assert list(moved) == ["a"]  # equal speeds: lowest peer_id
    decision = moved["a"]
    assert (decision.from_stage, decision.to_stage) == (0, 1)
    assert (decision.current_bottleneck, decision.new_bottleneck) == (1.0, 2.0)
    for pid in "bcd":
        assert not decide_move(pid, swarm, 2).move


def test_the_slower_of_equally_useful_peers_moves():
    # Stage 0 = 6, stage 1 = 1. Moving b (2) or c (3) both give a bottleneck of 3; b is slower.
    swarm = [online("a", 0, 1.0), online("b", 0, 2.0), online("c", 0, 3.0), online("d", 1, 1.0)]
    assert list(movers(swarm, 2)) == ["b"]


def test_result_does_not_depend_on_input_order():
    rng = random.Random(3)
    swarm = [online(f"p{i}", rng.randrange(3), rng.uniform(0.5, 2)) for i in range(20)]
    expected = movers(swarm, 3, min_gain=0.0)
    for _ in range(5):
        rng.shuffle(swarm)
        assert movers(swarm, 3, min_gain=0.0) == expected


def test_balanced_swarm_never_moves():
    swarm = [online(f"p{s}{i}", s, 1.0 + 0.01 * i) for s in range(4) for i in range(5)]
    assert movers(swarm, 4, min_gain=0.1) == {}
    exact = [online(f"p{s}{i}", s) for s in range(4) for i in range(3)]
    assert movers(exact, 4, min_gain=0.0) == {}


def test_single_replica_stage_is_never_left_empty():
    # Stage 1's only replica is very fast, stage 0 is starving: it still must not move.
    swarm = [online("slow", 0, 0.1), online("fast", 1, 100.0)]
    assert movers(swarm, 2, min_gain=0.0) == {}
    # A joining replica does not count as keeping the stage alive.
    swarm.append(ReplicaView("newcomer", 1, 5.0, "joining"))
    assert movers(swarm, 2, min_gain=0.0) == {}


def test_gain_below_margin_means_no_move():
    # 2.0 + 1.0 vs 1.8: moving the 1.0 peer would give min(2.0, 2.8) = 2.0, +11% over 1.8.
    swarm = [online("a", 0, 2.0), online("b", 0, 1.0), online("c", 1, 1.8)]
    assert movers(swarm, 2, min_gain=0.2) == {}
    assert list(movers(swarm, 2, min_gain=0.1)) == ["b"]


def test_joining_and_offline_peers():
    swarm = [
        online("a", 0),
        online("b", 0),
        online("c", 0),
        ReplicaView("j", 0, 1.0, "joining"),
        ReplicaView("gone", 1, 9.0, "offline"),
        online("d", 1),
    ]
    assert stage_throughputs(swarm, 2) == [4.0, 1.0]
    assert not decide_move("j", swarm, 2).move
    assert "joining" in decide_move("j", swarm, 2).reason
    # Moving one of four (1.0 each) to stage 1 gives 3 vs 2: only one plan member.
    assert list(movers(swarm, 2)) == ["a"]


def test_empty_stage_is_refilled():
    swarm = [online("a", 0), online("b", 0), online("c", 1)]
    decision = decide_move("a", swarm, 3)
    assert decision.move and decision.to_stage == 2 and decision.current_bottleneck == 0


def test_target_is_thinnest_stage_lowest_index_on_ties():
    swarm = [online(f"p{i}", 0) for i in range(6)] + [online("x", 1), online("y", 2)]
    plan = plan_rebalance(swarm, 3, min_gain=0.0)
    assert [m.to_stage for m in plan.moves] == [1, 2]
    assert plan.planned_bottleneck == 2.0


def test_unknown_self_and_malformed_snapshots_raise():
    with pytest.raises(ValueError, match="not in the snapshot"):
        decide_move("me", [online("a", 0)], 1)
    with pytest.raises(ValueError, match="outside"):
        stage_throughputs([online("a", 3)], 2)
    with pytest.raises(ValueError, match="duplicate"):
        stage_throughputs([online("a", 0), online("a", 1)], 2)


def test_choose_initial_stage_picks_the_thinnest():
    swarm = [online("a", 0, 3.0), online("b", 1, 1.0), online("c", 2, 2.0)]
    assert choose_initial_stage(swarm, 3, my_throughput=1.0) == 1
    assert choose_initial_stage(swarm, 4, my_throughput=1.0) == 3  # an empty stage first
    assert choose_initial_stage([], 3, my_throughput=1.0) == 0


def test_standby_helpers():
    swarm = [online("a", 0, 3.0), online("b", 1, 1.0), online("c", 1, 1.0), online("d", 2, 2.0)]
    assert choose_standby_target(swarm, 3) == 2  # 2.0 with one replica beats 2.0 with two
    assert not should_standby_take_over(swarm, 3, 1)
    assert should_standby_take_over(swarm, 3, 1, min_fraction=0.9)  # 2.0 < 0.9 * 2.5
    without_d = [r for r in swarm if r.peer_id != "d"]
    assert should_standby_take_over(without_d, 3, 2)  # stage 2 lost its last replica


def test_next_check_delay_is_randomised_within_bounds():
    rng = random.Random(0)
    delays = [next_check_delay_s(300.0, rng) for _ in range(200)]
    assert all(150.0 <= d <= 450.0 for d in delays)
    assert len(set(delays)) == len(delays)
    with pytest.raises(ValueError):
        next_check_delay_s(0.0, rng)


def brute_force_bottleneck(throughputs, num_stages):
    best = 0.0
    for labels in itertools.product(range(num_stages), repeat=len(throughputs)):
        sums = [0.0] * num_stages
        for x, s in zip(throughputs, labels):
            sums[s] += x
        best = max(best, min(sums))
    return best


def test_optimal_bottleneck_matches_brute_force():
    rng = random.Random(7)
    for _ in range(60):
        num_stages = rng.randint(1, 3)
        xs = [round(rng.uniform(0.1, 5.0), 3) for _ in range(rng.randint(0, 7))]
        expected = brute_force_bottleneck(xs, num_stages)
        assert optimal_bottleneck(xs, num_stages) == pytest.approx(expected, abs=1e-9)
        assert greedy_bottleneck(xs, num_stages) <= expected + 1e-9
        assert bottleneck_upper_bound(xs, num_stages) >= expected - 1e-9


def test_bounds_are_tight_for_many_peers():
    rng = random.Random(1)
    xs = [rng.lognormvariate(0, 0.6) for _ in range(400)]
    lower, upper = greedy_bottleneck(xs, 8), bottleneck_upper_bound(xs, 8)
    assert lower <= optimal_bottleneck(xs, 8) == upper
    assert lower >= 0.995 * upper
    assert bottleneck_upper_bound([10.0, 1.0, 1.0, 1.0], 2) == 3.0  # the big peer sits alone
    assert exact_bottleneck([10.0, 1.0, 1.0, 1.0], 2) == 3.0


snapshots = st.integers(1, 4).flatmap(
    lambda num_stages: st.tuples(
        st.just(num_stages),
        st.lists(
            st.tuples(
                st.integers(0, num_stages - 1),
                st.floats(0.0, 10.0, allow_nan=False),
                st.sampled_from(["online", "online", "online", "joining", "offline"]),
            ),
            min_size=1,
            max_size=12,
        ),
        st.sampled_from([0.0, 0.05, 0.1, 0.5]),
    )
)


@settings(max_examples=150, deadline=None)
@given(snapshots)
def test_a_move_never_empties_a_stage_nor_lowers_the_bottleneck(case):
    num_stages, rows, min_gain = case
    swarm = [ReplicaView(f"p{i}", s, x, state) for i, (s, x, state) in enumerate(rows)]
    before = stage_throughputs(swarm, num_stages)
    serving_now = [x for x in swarm if x.state == "online"]
    before_online = stage_throughputs(serving_now, num_stages)
    plan = plan_rebalance(swarm, num_stages, min_gain=min_gain)
    for r in swarm:
        decision = decide_move(r.peer_id, swarm, num_stages, min_gain=min_gain)
        if not decision.move:
            continue
        assert decision.new_bottleneck > decision.current_bottleneck * (1 + min_gain) or (
            decision.current_bottleneck == 0 < decision.new_bottleneck
        )
        after = [x for x in swarm if x.peer_id != r.peer_id] + [
            ReplicaView(r.peer_id, decision.to_stage, r.throughput, "joining")
        ]
        assert min(stage_throughputs(after, num_stages)) >= min(before)
        after_online = [x for x in serving_now if x.peer_id != r.peer_id]
        assert min(stage_throughputs(after_online, num_stages)) >= min(before_online)
        assert any(x.stage == r.stage and x.state == "online" for x in after)
    # The whole plan, in any subset, keeps an online replica on every stage that had one.
    moved = {m.peer_id for m in plan.moves}
    for stage in range(num_stages):
        had = [x for x in swarm if x.stage == stage and x.state == "online"]
        if had:
            assert any(x.peer_id not in moved for x in had)


def test_stages_that_lost_replicas_sees_departures_expiries_and_offline_records_not_moves():
    before = [
        online("a", 0),
        online("b", 0),
        online("c", 1),
        online("d", 2),
        ReplicaView("e", 2, 1.0, "joining"),
        online("f", 1),
    ]
    after = [
        online("a", 0),  # stayed
        ReplicaView("c", 1, 1.0, "offline"),  # announced offline: stage 1 lost it
        ReplicaView("f", 2, 1.0, "joining"),  # moved 1 -> 2 (planned): not a loss
        online("e", 2),  # joining -> online: not a loss
        online("g", 0),
    ]  # arrived
    # b's record expired (absent): stage 0 lost it; d's too: stage 2.
    assert stages_that_lost_replicas(before, after, 3) == (0, 1, 2)
    assert stages_that_lost_replicas(after, after, 3) == ()
    assert stages_that_lost_replicas([], after, 3) == ()
    # A joining peer that disappears was not serving yet: no loss.
    assert stages_that_lost_replicas([ReplicaView("e", 2, 1.0, "joining")], [], 3) == ()
    with pytest.raises(ValueError):
        stages_that_lost_replicas([online("a", 5)], [], 3)


def test_loss_check_delay_is_randomised_within_bounds():
    rng = random.Random(0)
    delays = [loss_check_delay_s(10.0, rng) for _ in range(1000)]
    assert all(0.0 <= d <= 10.0 for d in delays) and max(delays) - min(delays) > 9.0
    assert loss_check_delay_s(0.0, rng) == 0.0
    with pytest.raises(ValueError):
        loss_check_delay_s(-1.0, rng)


def test_decision_in_plan_agrees_with_decide_move():
    rng = random.Random(5)
    # Stage 2 thin: a plan moves peers there; joining peers are in the snapshot too.
    swarm = [
        ReplicaView(
            f"p{i}", rng.choice([0, 0, 1, 1, 2]), rng.uniform(0.5, 2), rng.choice(["online", "online", "joining"])
        )
        for i in range(30)
    ]
    plan = plan_rebalance(swarm, 3, min_gain=0.0)
    assert plan.moves  # the check below covers movers and stayers
    for me in swarm:
        assert decision_in_plan(me, plan) == decide_move(me.peer_id, swarm, 3, min_gain=0.0)
