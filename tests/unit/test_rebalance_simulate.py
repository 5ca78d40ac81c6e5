"""The rebalancing simulator is seeded and deterministic, and its shares are sane."""

from __future__ import annotations

from benchmarks.simulate import SimulationConfig, simulate


def test_small_simulation_is_deterministic_and_bounded():
    config = SimulationConfig(seed=3, peers=60, stages=4, duration_s=1800.0, join_scale=0.0,
                              min_gain=0.01, check_period_s=120.0)
    first, second = simulate(config), simulate(config)
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second
    for figures in first["policies"].values():
        assert 0.0 < figures["share_of_optimal"] <= 1.0
    assert first["policies"]["static"]["moves"] == 0
    assert first["policies"]["rebalance"]["moves"] > 0
