"""The rebalancing simulator is seeded and deterministic, and its shares are sane."""

from __future__ import annotations

from benchmarks.simulate import PeerLife, SimulationConfig, generate_trace, replay, simulate


def simulated_twice_identically(config: SimulationConfig) -> dict:
    """Simulate `config` twice and check the reports agree (wall time aside); return the first."""
    first, second = simulate(config), simulate(config)
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second
    return first


def test_small_simulation_is_deterministic_and_bounded():
    first = simulated_twice_identically(
        SimulationConfig(
            seed=3, peers=60, stages=4, duration_s=1800.0, join_scale=0.0, min_gain=0.01, check_period_s=120.0
        )
    )
    for figures in first["policies"].values():
        assert 0.0 < figures["share_of_optimal"] <= 1.0
    assert first["policies"]["static"]["moves"] == 0
    assert first["policies"]["rebalance"]["moves"] > 0


def _standby_trace(stage1_speeds: list[float]) -> list[PeerLife]:
    """Stage 0: one 3.0 peer; stage 1: the given peers (placed in order by choose_initial_stage);
    the last stage-1 peer leaves at t=310 s (announcing offline); then a standby (last entry)."""
    lives = [PeerLife("a-stage0", 0, 3.0, 0.0, 10_000.0, False)]
    for k, speed in enumerate(stage1_speeds):
        leaves_s = 310.0 if k == len(stage1_speeds) - 1 else 10_000.0
        lives.append(PeerLife(f"b-stage1-{k}", 0, speed, 0.0, leaves_s, False))
    lives.append(PeerLife("standby", 0, 3.0, 0.0, 10_000.0, False))
    return lives


def _samples(trace: list[PeerLife], **overrides) -> dict:
    # No refresh after the first download: a refresh in progress (120 s) would delay the take-over.
    config = SimulationConfig(peers=2, stages=2, duration_s=600.0, standby_refresh_s=10_000.0, **overrides)
    flags = [life.peer_id == "standby" for life in trace]
    return replay(trace, config, "static", is_standby=flags)


def test_a_standby_takes_over_a_stage_left_without_replica_at_once():
    # Stage 1 = one 2.0 peer (not below 0.5 x 3.0: no take-over yet); it leaves at 310 s. The
    # standby (3.0) holds stage 1, the thinnest.
    result = _samples(_standby_trace([2.0]))
    series = result["samples_per_s"]  # samples at 0, 60, ..., 540 s
    assert series[5] == 2.0  # t=300 s
    assert series[6] == 3.0  # t=360 s: serving from its copy, no download (no replica to download from)
    assert result["standby_take_overs"] == 1


def test_taking_over_a_stage_that_fell_behind_first_downloads_its_state_as_the_peer_does():
    # Stage 1 = 2.0 + 0.9 (not below 0.9 x 3.0); the 0.9 peer leaves at 310 s: 2.0 < 2.7 -> take
    # over, but a replica is online, so the peer downloads the latest state first (transfer_s = 120 s).
    trace = _standby_trace([2.0, 0.9])
    downloading = _samples(trace, standby_take_over_fraction=0.9)["samples_per_s"]
    assert downloading[6] == 2.0 and downloading[7] == 2.0  # t=360, 420 s: still downloading
    assert downloading[5] == 2.9 and downloading[8] == 3.0  # t=300 s: both there; t=480 s: serving
    instant = _samples(trace, standby_take_over_fraction=0.9, standby_instant_take_over=True)["samples_per_s"]
    assert instant[6] == 3.0  # the hypothetical peer serves from its held copy at once
    never = _samples(trace, standby_take_over_fraction=0.0)  # 0: only a stage with no online replica
    assert never["standby_take_overs"] == 0 and never["samples_per_s"][-1] == 2.0


def test_standbys_serve_nothing_until_they_take_over_and_the_draw_is_seeded():
    first = simulated_twice_identically(
        SimulationConfig(
            seed=3,
            peers=60,
            stages=4,
            duration_s=1800.0,
            join_scale=0.0,
            standby_fraction=0.2,
            standby_take_over_fraction=0.9,
        )
    )
    static = first["policies"]["static"]
    assert static["standby_peers"] > 0
    assert 0 < static["standby_take_overs"] + static["standby_at_end"] <= static["standby_peers"]


def test_a_check_on_loss_repairs_the_bottleneck_long_before_the_periodic_check():
    # Placed in order: stage 0 = p0 (2.0) + p2 + p4 (1.0 each) = 4, stage 1 = p1 (2.0) + p3 (1.0) = 3.
    # p1 leaves at 100 s (announcing offline): stage 1 = 1. The plan moves p2 (the slower, then
    # lower id, of the equally useful movers) to stage 1: bottleneck 2 once its 120 s download is done.
    speeds_and_departures = [(2.0, 10_000.0), (2.0, 100.0), (1.0, 10_000.0), (1.0, 10_000.0), (1.0, 10_000.0)]
    trace = [
        PeerLife(f"p{k}", 0, speed, 0.0, leaves_s, False) for k, (speed, leaves_s) in enumerate(speeds_and_departures)
    ]
    flags = [False] * len(trace)

    def series(check_on_loss: bool) -> dict:
        config = SimulationConfig(
            peers=2,
            stages=2,
            duration_s=600.0,
            check_period_s=5000.0,
            check_on_loss=check_on_loss,
            loss_check_max_delay_s=10.0,
        )
        return replay(trace, config, "rebalance", is_standby=flags)

    periodic, on_loss = series(False), series(True)
    assert periodic["samples_per_s"][1:] == [3.0] + [1.0] * 8  # first periodic check at >= 2500 s
    assert periodic["moves"] == 0
    # The loss is seen in the view at 105 s, the check follows within 10 s, the move lands 120 s later.
    assert on_loss["samples_per_s"][1:4] == [3.0, 1.0, 1.0] and on_loss["samples_per_s"][4:] == [2.0] * 6
    assert on_loss["moves"] == 1 and on_loss["loss_checks"] >= 1


def test_the_breakdown_accounts_for_the_whole_gap_to_the_optimum():
    from benchmarks.simulate_breakdown import breakdown

    config = SimulationConfig(seed=3, peers=60, stages=4, duration_s=1800.0, join_scale=0.0, check_period_s=120.0)
    report = breakdown(config)
    assert report["share_of_optimal"] == simulate(config)["policies"]["rebalance"]["share_of_optimal"]
    gap_points = 100 * (1 - report["share_of_optimal"])
    assert gap_points > 0
    by_landing = report["lost_points_by_landing"]
    telescoped = (
        by_landing["transfers_landing"] + by_landing["placement_once_landed"] + by_landing["optimum_minus_best_all"]
    )
    assert abs(telescoped - gap_points) < 1e-9
    placement = (
        by_landing["of_which_plan_not_yet_acted_on"]
        + by_landing["of_which_min_gain"]
        + by_landing["of_which_planner_limit"]
    )
    assert abs(placement - by_landing["placement_once_landed"]) < 1e-9
    assert (
        abs(
            sum(report["imbalance_by_time_since_bottleneck_lost_a_peer_points"].values())
            - sum(v for k, v in report["lost_points"].items() if k != "in_transit")
        )
        < 1e-9
    )


def test_the_settle_rule_holds_periodic_checks_back_only_when_it_is_on():
    base = dict(seed=3, peers=24, stages=4, duration_s=3600.0, join_scale=0.0, check_period_s=60.0, return_periods=0.0)
    settling = SimulationConfig(**base)
    free = SimulationConfig(**base, settle_periods=0.0)
    trace = generate_trace(settling)
    assert trace == generate_trace(free)  # the same churn
    held, unheld = replay(trace, settling, "rebalance"), replay(trace, free, "rebalance")
    assert held["settling_checks"] > 0 and unheld["settling_checks"] == 0
    assert held["moves"] < unheld["moves"]  # in a small swarm each mover is a material share of its stage


def test_the_no_return_rule_bars_moves_that_undo_recent_ones_only_when_it_is_on():
    base = dict(seed=0, peers=24, stages=4, duration_s=3600.0, join_scale=1.0, check_period_s=60.0, settle_periods=0.0)
    barring, free = SimulationConfig(**base), SimulationConfig(**base, return_periods=0.0)
    trace = generate_trace(barring)
    held, unheld = replay(trace, barring, "rebalance"), replay(trace, free, "rebalance")
    assert held["returns_barred"] > 0 and unheld["returns_barred"] == 0
    assert held["moves"] < unheld["moves"]
