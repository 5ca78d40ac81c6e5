"""The DT-FM communication cost of a plan (Yuan et al., 2022, section 3), exactly as SEEDS.md states.

A plan is a balanced partition of the N devices into ``stages`` groups of ``replicas`` devices
(group = the devices serving one pipeline stage). Its cost in seconds is

    DATAP     = max over groups C of  max_{d in C} sum_{d' in C, d' != d} 2*(a_dd' + c_dp/(D_DP*b_dd'))
    E(C, C')  = min over perfect matchings M of C x C' of max_{(d, d') in M} 2*(a_dd' + c_pp/b_dd')
    PIPELINEP = the cheapest open path that visits every group once, with edge costs E
    total     = DATAP + PIPELINEP

with a in seconds, b in Gbit/s and sizes in Gbit (GB x 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from swarm.planner.topology import Topology

__all__ = [
    "PairCosts",
    "PlanCost",
    "pair_costs",
    "group_data_parallel_costs",
    "bottleneck_assignment_costs",
    "pipeline_edge_costs",
    "shortest_open_path",
    "evaluate_plan",
]

BITS_PER_BYTE = 8.0
# Largest group size for the vectorised Hall-theorem matching check (2**k subsets per matrix).
MAX_VECTORISED_REPLICAS = 12
# Largest number of groups for the exact open-path (Held-Karp) dynamic programme.
MAX_EXACT_PATH_GROUPS = 14


@dataclass(frozen=True, eq=False)
class PairCosts:
    """Per-device-pair costs in seconds, precomputed once per topology.

    Attributes:
        data_parallel_s: (N, N) 2*(a + c_dp/(D_DP*b)); zero on the diagonal.
        pipeline_s: (N, N) 2*(a + c_pp/b); zero on the diagonal (never used there).
        stages: number of groups G.
        replicas: devices per group R.
    """

    data_parallel_s: np.ndarray
    pipeline_s: np.ndarray
    stages: int
    replicas: int

    @property
    def num_devices(self) -> int:
        """N = stages * replicas."""
        return self.stages * self.replicas


@dataclass(frozen=True)
class PlanCost:
    """The cost of a partition, with the pipeline order that achieves it.

    Attributes:
        data_parallel_s: DATAP, the slowest group's gradient averaging.
        pipeline_s: PIPELINEP, the cheapest open path through the groups.
        total_s: data_parallel_s + pipeline_s.
        order: group indices in pipeline order (the path that achieves pipeline_s).
    """

    data_parallel_s: float
    pipeline_s: float
    total_s: float
    order: tuple[int, ...]


def pair_costs(topology: Topology) -> PairCosts:
    """Precompute the (N, N) data-parallel and pipeline per-pair costs in seconds."""
    latency_s = topology.latency_s  # (N, N) s
    bandwidth = topology.bandwidth_gbps  # (N, N) Gbit/s, inf on the diagonal
    dp_gbit = topology.c_dp_gb * BITS_PER_BYTE / topology.replicas
    pp_gbit = topology.c_pp_gb * BITS_PER_BYTE
    data_parallel_s = 2.0 * (latency_s + dp_gbit / bandwidth)  # (N, N) s
    pipeline_s = 2.0 * (latency_s + pp_gbit / bandwidth)  # (N, N) s
    np.fill_diagonal(data_parallel_s, 0.0)
    np.fill_diagonal(pipeline_s, 0.0)
    data_parallel_s.setflags(write=False)
    pipeline_s.setflags(write=False)
    return PairCosts(data_parallel_s, pipeline_s, topology.stages, topology.replicas)


def group_data_parallel_costs(data_parallel_s: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """DATAP of each group: (G, R) device indices -> (G,) seconds."""
    groups = np.asarray(groups)
    within = data_parallel_s[groups[:, :, None], groups[:, None, :]]  # (G, R, R)
    return within.sum(axis=2).max(axis=1)


def _perfect_matching_exists(allowed: np.ndarray) -> np.ndarray:
    """Hall's condition on a batch of bipartite graphs: (B, k, k) bool -> (B,) bool.

    A perfect matching exists iff every set S of rows reaches at least |S| columns. Row
    neighbourhoods are bit masks; the neighbourhood of every subset is built by doubling.
    """
    batch, k, _ = allowed.shape
    column_bits = np.left_shift(np.int64(1), np.arange(k, dtype=np.int64))  # (k,)
    row_masks = (allowed * column_bits).sum(axis=2)  # (B, k) int64
    reach = np.zeros((batch, 1 << k), dtype=np.int64)  # (B, 2**k) neighbourhood of each subset
    for row in range(k):
        low = 1 << row
        reach[:, low : 2 * low] = reach[:, :low] | row_masks[:, row : row + 1]
    subset_sizes = np.bitwise_count(np.arange(1 << k, dtype=np.int64))  # (2**k,)
    return (np.bitwise_count(reach) >= subset_sizes).all(axis=1)


def _bottleneck_vectorised(costs: np.ndarray) -> np.ndarray:
    """Exact bottleneck assignment of (B, k, k) matrices, k <= MAX_VECTORISED_REPLICAS."""
    batch, k, _ = costs.shape
    # Every row and every column must be matched: a lower bound that is usually tight.
    lower = np.maximum(costs.min(axis=2).max(axis=1), costs.min(axis=1).max(axis=1))  # (B,)
    result = lower.copy()
    tight = _perfect_matching_exists(costs <= lower[:, None, None])
    loose = np.flatnonzero(~tight)
    if loose.size == 0:
        return result
    sub = costs[loose]  # (L, k, k)
    values = np.sort(sub.reshape(loose.size, k * k), axis=1)  # (L, k*k) candidate thresholds
    rows = np.arange(loose.size)
    low = np.array([np.searchsorted(v, b, side="right") for v, b in zip(values, lower[loose])])
    high = np.full(loose.size, k * k - 1)  # the largest entry always admits a matching
    while True:
        active = np.flatnonzero(low < high)
        if active.size == 0:
            break
        mid = (low[active] + high[active]) // 2
        threshold = values[active, mid]  # (A,)
        feasible = _perfect_matching_exists(sub[active] <= threshold[:, None, None])
        high[active] = np.where(feasible, mid, high[active])
        low[active] = np.where(feasible, low[active], mid + 1)
    result[loose] = values[rows, low]
    return result


def _bottleneck_scipy(costs: np.ndarray) -> float:
    """Exact bottleneck assignment of one (k, k) matrix by binary search over its entries."""
    k = costs.shape[0]
    values = np.unique(costs)
    low, high = 0, values.size - 1
    while low < high:
        mid = (low + high) // 2
        graph = csr_matrix((costs <= values[mid]).astype(np.int8))
        matched = maximum_bipartite_matching(graph, perm_type="column")
        if np.count_nonzero(matched >= 0) == k:
            high = mid
        else:
            low = mid + 1
    return float(values[low])


def bottleneck_assignment_costs(costs: np.ndarray) -> np.ndarray:
    """min over perfect matchings of the max matched entry, for (..., k, k) -> (...) matrices."""
    costs = np.asarray(costs, dtype=np.float64)
    *batch_shape, k, k2 = costs.shape
    if k != k2:
        raise ValueError(f"bottleneck assignment needs square matrices, got {k} x {k2}")
    flat = costs.reshape(-1, k, k)
    if k <= MAX_VECTORISED_REPLICAS:
        chunk = max(1, (1 << 22) >> k)  # bound the (chunk, 2**k) subset table to ~32 MB
        parts = [_bottleneck_vectorised(flat[i : i + chunk]) for i in range(0, len(flat), chunk)]
        out = np.concatenate(parts) if parts else np.zeros(0)
    else:
        out = np.array([_bottleneck_scipy(matrix) for matrix in flat])
    return out.reshape(batch_shape)


def pipeline_edge_costs(pipeline_s: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """E(C_i, C_j) for every pair of groups: (G, R) device indices -> (G, G) seconds."""
    groups = np.asarray(groups)
    count = groups.shape[0]
    first, second = np.triu_indices(count, k=1)
    blocks = pipeline_s[groups[first][:, :, None], groups[second][:, None, :]]  # (P, R, R)
    edges = np.zeros((count, count))
    edges[first, second] = bottleneck_assignment_costs(blocks)
    edges[second, first] = edges[first, second]
    return edges


def _open_path_exact(edges: np.ndarray) -> tuple[float, list[int]]:
    """Held-Karp over subsets: the cheapest Hamiltonian path, any start and end."""
    count = edges.shape[0]
    full = (1 << count) - 1
    best = np.full((1 << count, count), np.inf)  # best[S, j]: cheapest path over S ending at j
    came_from = np.full((1 << count, count), -1, dtype=np.int64)
    for node in range(count):
        best[1 << node, node] = 0.0
    bits = 1 << np.arange(count)
    for subset in range(1, full):
        ends = best[subset]  # (G,)
        if not np.isfinite(ends).any():
            continue
        extended = ends[:, None] + edges  # (G end, G next)
        previous = extended.argmin(axis=0)  # (G,)
        cost = extended[previous, np.arange(count)]
        for node in np.flatnonzero((subset & bits) == 0):
            target = subset | (1 << node)
            if cost[node] < best[target, node]:
                best[target, node] = cost[node]
                came_from[target, node] = previous[node]
    end = int(np.argmin(best[full]))
    total = float(best[full, end])
    order = [end]
    subset = full
    while came_from[subset, order[-1]] >= 0:
        previous = int(came_from[subset, order[-1]])
        subset &= ~(1 << order[-1])
        order.append(previous)
    order.reverse()
    return total, order


def _path_cost(edges: np.ndarray, order: list[int]) -> float:
    return float(sum(edges[a, b] for a, b in zip(order, order[1:])))


def _open_path_heuristic(edges: np.ndarray) -> tuple[float, list[int]]:
    """Nearest neighbour from every start, then 2-opt; an upper bound for many groups."""
    count = edges.shape[0]
    best_cost, best_order = np.inf, list(range(count))
    for start in range(count):
        order, left = [start], set(range(count)) - {start}
        while left:
            nxt = min(left, key=lambda node: (edges[order[-1], node], node))
            order.append(nxt)
            left.remove(nxt)
        improved = True
        while improved:
            improved = False
            for i in range(count - 1):
                for j in range(i + 1, count):
                    candidate = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                    if _path_cost(edges, candidate) < _path_cost(edges, order) - 1e-12:
                        order, improved = candidate, True
        cost = _path_cost(edges, order)
        if cost < best_cost:
            best_cost, best_order = cost, order
    return best_cost, best_order


def shortest_open_path(edges: np.ndarray) -> tuple[float, list[int]]:
    """The cheapest path visiting every group once (open-loop TSP): (G, G) -> (seconds, order).

    Exact (Held-Karp) for up to MAX_EXACT_PATH_GROUPS groups, a 2-opt heuristic beyond.
    """
    edges = np.asarray(edges, dtype=np.float64)
    count = edges.shape[0]
    if count <= 1:
        return 0.0, list(range(count))
    if count <= MAX_EXACT_PATH_GROUPS:
        return _open_path_exact(edges)
    return _open_path_heuristic(edges)


def evaluate_plan(costs: PairCosts, groups: np.ndarray) -> PlanCost:
    """The exact DT-FM cost of a balanced partition given as (G, R) device indices."""
    groups = np.asarray(groups, dtype=np.int64)
    expected = (costs.stages, costs.replicas)
    if groups.shape != expected:
        raise ValueError(f"groups must have shape {expected}, got {groups.shape}")
    if not np.array_equal(np.sort(groups.ravel()), np.arange(costs.num_devices)):
        raise ValueError("groups must use every device exactly once")
    data_parallel = float(group_data_parallel_costs(costs.data_parallel_s, groups).max())
    pipeline, order = shortest_open_path(pipeline_edge_costs(costs.pipeline_s, groups))
    return PlanCost(data_parallel, pipeline, data_parallel + pipeline, tuple(order))
