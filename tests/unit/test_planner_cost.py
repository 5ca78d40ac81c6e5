"""The DT-FM cost model: reference figures, matching and path solvers, topology validation."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from swarm.planner.cost import (
    _bottleneck_scipy,
    bottleneck_assignment_costs,
    evaluate_plan,
    pair_costs,
    shortest_open_path,
)
from swarm.planner.topology import TopologyError, load_topology, topology_from_dict

SCENARIOS = Path(__file__).resolve().parents[2] / "benchmarks" / "dtfm_scenarios"

# SEEDS.md section 2: costs (s) of the Megatron-like layout and the paper's best layout.
MEGATRON_S = {"case1": 16.98, "case2": 49.50, "case3": 17.65, "case4": 39.24, "case5": 59.44}
PAPER_BEST_S = {"case1": 3.44, "case2": 49.50, "case3": 16.09, "case4": 34.80, "case5": 49.22}


def small_topology_dict(stages: int, replicas: int, seed: int) -> dict:
    """A random asymmetric topology (latency 0-50 ms, bandwidth 0.2-10 Gbit/s)."""
    rng = np.random.default_rng(seed)
    size = stages * replicas
    return {
        "name": f"random-{stages}x{replicas}-{seed}",
        "stages": stages,
        "replicas": replicas,
        "c_dp_gb": 0.65,
        "c_pp_gb": 0.47,
        "latency_ms": rng.uniform(0, 50, (size, size)).tolist(),
        "bandwidth_gbps": rng.uniform(0.2, 10, (size, size)).tolist(),
    }


@pytest.mark.parametrize("case", sorted(MEGATRON_S))
def test_megatron_layout_matches_seeds(case: str) -> None:
    topology = load_topology(SCENARIOS / f"{case}.json")
    groups = np.arange(64).reshape(8, 8)  # group j = devices 8j..8j+7
    assert evaluate_plan(pair_costs(topology), groups).total_s == pytest.approx(MEGATRON_S[case], abs=0.01)


@pytest.mark.parametrize("case", sorted(PAPER_BEST_S))
def test_one_pipeline_per_block_matches_paper_best(case: str) -> None:
    # The paper's best layouts have the cost of group j = {j, j+8, ..., j+56}.
    topology = load_topology(SCENARIOS / f"{case}.json")
    groups = np.arange(64).reshape(8, 8).T
    assert evaluate_plan(pair_costs(topology), groups).total_s == pytest.approx(PAPER_BEST_S[case], abs=0.01)


def test_cost_by_hand_on_two_by_two() -> None:
    # Devices 0,1 | 2,3; latency 10 ms everywhere; bandwidth 1 Gbit/s except 0-1 and 2-3 at 4.
    bandwidth = np.ones((4, 4))
    bandwidth[0, 1] = bandwidth[1, 0] = bandwidth[2, 3] = bandwidth[3, 2] = 4.0
    topology = topology_from_dict(
        {
            "stages": 2,
            "replicas": 2,
            "c_dp_gb": 1.0,
            "c_pp_gb": 0.5,
            "latency_ms": np.full((4, 4), 10.0).tolist(),
            "bandwidth_gbps": bandwidth.tolist(),
        }
    )
    cost = evaluate_plan(pair_costs(topology), np.array([[0, 1], [2, 3]]))
    assert cost.data_parallel_s == pytest.approx(2 * (0.01 + 8 * 1.0 / (2 * 4.0)))
    assert cost.pipeline_s == pytest.approx(2 * (0.01 + 8 * 0.5 / 1.0))
    assert cost.total_s == pytest.approx(cost.data_parallel_s + cost.pipeline_s)


def brute_force_bottleneck(matrix: np.ndarray) -> float:
    size = matrix.shape[0]
    return min(max(matrix[i, p[i]] for i in range(size)) for p in itertools.permutations(range(size)))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 6])
def test_bottleneck_assignment_is_exact(size: int) -> None:
    rng = np.random.default_rng(size)
    continuous = rng.uniform(0, 1, (20, size, size))
    ties = rng.integers(0, 4, (20, size, size)).astype(float)  # many equal entries
    for batch in (continuous, ties):
        fast = bottleneck_assignment_costs(batch)
        assert fast.shape == (20,)
        for matrix, value in zip(batch, fast):
            assert value == brute_force_bottleneck(matrix)
            assert _bottleneck_scipy(matrix) == value


def test_bottleneck_assignment_beyond_vectorised_size() -> None:
    rng = np.random.default_rng(7)
    batch = rng.uniform(0, 1, (3, 13, 13))
    expected = [_bottleneck_scipy(matrix) for matrix in batch]
    assert bottleneck_assignment_costs(batch).tolist() == expected


@pytest.mark.parametrize("count", [1, 2, 4, 6, 7])
def test_shortest_open_path_is_exact(count: int) -> None:
    rng = np.random.default_rng(count)
    edges = rng.uniform(0, 10, (count, count))
    edges = (edges + edges.T) / 2
    cost, order = shortest_open_path(edges)
    assert sorted(order) == list(range(count))
    assert cost == pytest.approx(sum(edges[a, b] for a, b in zip(order, order[1:])))
    best = min(sum(edges[a, b] for a, b in zip(p, p[1:])) for p in itertools.permutations(range(count)))
    assert cost == pytest.approx(best)


def test_evaluate_plan_rejects_unbalanced_groups() -> None:
    costs = pair_costs(topology_from_dict(small_topology_dict(2, 2, 0)))
    with pytest.raises(ValueError, match="every device exactly once"):
        evaluate_plan(costs, np.array([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match="shape"):
        evaluate_plan(costs, np.array([[0, 1, 2, 3]]))


def test_topology_is_symmetrised_in_seconds() -> None:
    data = small_topology_dict(2, 2, 1)
    topology = topology_from_dict(data)
    latency = np.array(data["latency_ms"])
    bandwidth = np.array(data["bandwidth_gbps"])
    assert topology.latency_s[0, 1] == pytest.approx((latency[0, 1] + latency[1, 0]) / 2 / 1e3)
    assert topology.bandwidth_gbps[1, 0] == pytest.approx((bandwidth[0, 1] + bandwidth[1, 0]) / 2)
    assert np.array_equal(topology.latency_s, topology.latency_s.T)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("stages"), "missing field 'stages'"),
        (lambda d: d.update(replicas=0), "'replicas' must be a positive integer"),
        (lambda d: d.update(replicas=3), "but stages \\* replicas = 6"),
        (lambda d: d.update(c_pp_gb=-1.0), "'c_pp_gb' must be positive"),
        (lambda d: d.update(c_dp_gb="big"), "'c_dp_gb' must be a finite number"),
        (lambda d: d["latency_ms"].pop(), "must be a square"),
        (lambda d: d["latency_ms"][1].pop(), "N x N list"),
        (lambda d: d["latency_ms"][0].__setitem__(1, -2.0), "latency_ms\\[0\\]\\[1\\] .* negative"),
        (lambda d: d["bandwidth_gbps"][2].__setitem__(3, 0.0), "bandwidth_gbps\\[2\\]\\[3\\]"),
        (lambda d: d["bandwidth_gbps"][2].__setitem__(3, float("nan")), "non-finite"),
        (lambda d: d.pop("bandwidth_gbps"), "missing field 'bandwidth_gbps'"),
    ],
)
def test_topology_validation_errors(change, message: str) -> None:
    data = small_topology_dict(2, 2, 2)
    change(data)
    with pytest.raises(TopologyError, match=message):
        topology_from_dict(data)


def test_topology_error_is_a_value_error_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        load_topology(path)
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(TopologyError, match="JSON object"):
        load_topology(path)
