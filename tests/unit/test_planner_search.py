"""The plan search: exact on small topologies, deterministic, independent of device numbering."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.planner.cost import evaluate_plan, pair_costs
from swarm.planner.search import canonical_device_order, search_plan
from swarm.planner.topology import load_topology, topology_from_dict
from tests.unit.test_planner_cost import PAPER_BEST_S, SCENARIOS, small_topology_dict


def balanced_partitions(devices: list[int], size: int):
    """Every partition of ``devices`` into groups of ``size`` (groups unordered)."""
    if not devices:
        yield []
        return
    first, rest = devices[0], devices[1:]
    for others in _combinations(rest, size - 1):
        remaining = [d for d in rest if d not in others]
        for tail in balanced_partitions(remaining, size):
            yield [[first, *others], *tail]


def _combinations(items: list[int], count: int):
    if count == 0:
        yield []
        return
    for index in range(len(items) - count + 1):
        for tail in _combinations(items[index + 1 :], count - 1):
            yield [items[index], *tail]


def brute_force_optimum(topology) -> float:
    costs = pair_costs(topology)
    return min(
        evaluate_plan(costs, np.array(groups)).total_s
        for groups in balanced_partitions(list(range(topology.num_devices)), topology.replicas)
    )


@pytest.mark.parametrize(
    ("stages", "replicas", "seed"),
    [
        (2, 4, 0),
        (4, 2, 1),
        (3, 3, 2),
        (3, 3, 3),
        (3, 3, 7),
        (3, 3, 8),
        (2, 5, 4),
        (2, 6, 9),
        (5, 2, 5),
        (4, 2, 10),
        pytest.param(4, 3, 6, marks=pytest.mark.slow),  # 15,400 partitions to brute-force
        pytest.param(3, 4, 12, marks=pytest.mark.slow),  # 5,775 partitions
    ],
)
def test_search_finds_brute_force_optimum(stages: int, replicas: int, seed: int) -> None:
    topology = topology_from_dict(small_topology_dict(stages, replicas, seed))
    result = search_plan(topology, seed=0, time_limit_s=30, max_rounds=20)
    assert result.cost.total_s == pytest.approx(brute_force_optimum(topology), abs=1e-9)


def test_result_is_a_valid_plan_with_its_exact_cost() -> None:
    topology = topology_from_dict(small_topology_dict(4, 3, 11))
    result = search_plan(topology, seed=3, time_limit_s=30, max_rounds=10)
    assert result.groups.shape == (4, 3)
    assert sorted(result.groups.ravel().tolist()) == list(range(12))
    recomputed = evaluate_plan(pair_costs(topology), result.groups)
    assert recomputed.total_s == pytest.approx(result.cost.total_s)
    # Groups come in pipeline order: the path 0, 1, ..., G-1 achieves the pipeline cost.
    from swarm.planner.cost import pipeline_edge_costs

    edges = pipeline_edge_costs(pair_costs(topology).pipeline_s, result.groups)
    assert sum(edges[g, g + 1] for g in range(3)) == pytest.approx(result.cost.pipeline_s)


def test_same_seed_same_plan() -> None:
    topology = topology_from_dict(small_topology_dict(4, 4, 21))
    first = search_plan(topology, seed=5, time_limit_s=30, max_rounds=8)
    second = search_plan(topology, seed=5, time_limit_s=30, max_rounds=8)
    assert np.array_equal(first.groups, second.groups)
    assert first.cost == second.cost
    assert first.rounds == second.rounds == 8


@pytest.mark.parametrize("permutation_seed", [0, 1, 2])
def test_renumbering_devices_does_not_change_the_cost(permutation_seed: int) -> None:
    topology = topology_from_dict(small_topology_dict(4, 4, 31))
    permutation = np.random.default_rng(permutation_seed).permutation(16)
    renamed = topology.permuted(permutation)
    plain = search_plan(topology, seed=1, time_limit_s=30, max_rounds=6)
    permuted = search_plan(renamed, seed=1, time_limit_s=30, max_rounds=6)
    assert permuted.cost.total_s == plain.cost.total_s
    # The very same plan, up to the renaming (and the direction the pipeline is read in).
    mapped = {frozenset(permutation[g].tolist()) for g in permuted.groups}
    assert mapped == {frozenset(g.tolist()) for g in plain.groups}


def test_renumbering_a_scenario_does_not_change_the_cost() -> None:
    topology = load_topology(SCENARIOS / "case3.json")
    renamed = topology.permuted(np.random.default_rng(0).permutation(64))
    plain = search_plan(topology, seed=0, time_limit_s=30, max_rounds=2)
    permuted = search_plan(renamed, seed=0, time_limit_s=30, max_rounds=2)
    assert permuted.cost.total_s == pytest.approx(plain.cost.total_s, abs=1e-9)


def test_canonical_order_follows_the_devices() -> None:
    topology = topology_from_dict(small_topology_dict(3, 3, 41))
    permutation = np.random.default_rng(1).permutation(9)
    plain = canonical_device_order(pair_costs(topology))
    renamed = canonical_device_order(pair_costs(topology.permuted(permutation)))
    assert np.array_equal(permutation[renamed], plain)


def test_time_limit_is_respected() -> None:
    topology = load_topology(SCENARIOS / "case5.json")
    result = search_plan(topology, seed=0, time_limit_s=0.5, patience_rounds=None)
    assert result.stopped_by_time
    assert result.elapsed_s < 5.0  # one local search in progress may finish after the limit


@pytest.mark.parametrize("case", ["case1", "case2"])
def test_first_rounds_reach_the_paper_on_data_centre_cases(case: str) -> None:
    topology = load_topology(SCENARIOS / f"{case}.json")
    result = search_plan(topology, seed=0, time_limit_s=30, max_rounds=1)
    assert result.cost.total_s <= PAPER_BEST_S[case] + 0.01
    if case == "case2":
        assert result.cost.total_s < 31.7


def test_bad_budgets_are_rejected() -> None:
    topology = topology_from_dict(small_topology_dict(2, 2, 0))
    with pytest.raises(ValueError, match="time_limit_s"):
        search_plan(topology, time_limit_s=0)
    with pytest.raises(ValueError, match="max_rounds"):
        search_plan(topology, max_rounds=0)
