"""Search for a balanced partition with a low DT-FM cost (see ``cost.py``).

Iterated local search over *ordered* partitions: a state is G groups of R devices in pipeline
order, and its cost is DATAP plus the cost of that path. Moves swap two devices between groups;
all R*R swaps between two groups are scored at once with numpy, touching only the two groups'
DATAP and the (at most four) pipeline edges next to them. When no swap helps, the exact open-path
solver re-orders the groups, and the loop goes on until neither helps. Plateaus of the max-type
objective are crossed with a secondary score (the mean of the groups' DATAP plus a relaxation of
each path edge's matching: mean cheapest link per row and column), compared only when totals tie.

Restarts come from label-independent constructions (R pipelines grown stage by stage from
well-spread heads; tight clusters as pipelines, the DT-FM paper's best layouts; tight clusters
as stages, Megatron-like) and random partitions; then random swap kicks of the current state,
until no better plan has come for ``patience_rounds`` rounds. Devices are first put in a
canonical order computed from the costs alone, so renumbering the devices of a topology does
not change the result. The search is deterministic for a seed unless the time limit, a safety
net, stops it first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from swarm.planner.cost import (
    PairCosts,
    PlanCost,
    bottleneck_assignment_costs,
    evaluate_plan,
    group_data_parallel_costs,
    pair_costs,
    pipeline_edge_costs,
    shortest_open_path,
)
from swarm.planner.topology import Topology

__all__ = ["SearchResult", "search_plan", "canonical_device_order"]

# Costs closer than this (seconds) count as equal.
TIE_S = 1e-9
# Rounds of colour refinement for the canonical device order.
REFINEMENT_ROUNDS = 5
# Every this many rounds, a fresh construction instead of a kick of the current state.
RESTART_EVERY = 5
# Rounds without improvement after which the search stops (it has converged).
DEFAULT_PATIENCE_ROUNDS = 30


@dataclass(frozen=True)
class SearchResult:
    """The best plan found.

    Attributes:
        groups: (G, R) device indices, one row per stage in pipeline order, rows sorted.
        cost: its exact cost (``order`` is 0..G-1 since groups are already in pipeline order).
        seed: the seed the search ran with.
        elapsed_s: wall time spent searching.
        rounds: local searches completed.
        best_found_s: wall time at which the best plan was first reached.
        stopped_by_time: True if the time limit ended the search (not the round budget or
            patience); results are then reproducible only on a machine as fast.
    """

    groups: np.ndarray
    cost: PlanCost
    seed: int
    elapsed_s: float
    rounds: int
    best_found_s: float
    stopped_by_time: bool


def canonical_device_order(costs: PairCosts) -> np.ndarray:
    """Devices sorted by a signature computed from costs only: (N,) original indices.

    Colour refinement (Weisfeiler-Lehman): a device's colour is its previous colour with the
    sorted multiset of (neighbour colour, link costs). Devices that end with equal colours are
    ordered by index; on the scenarios these are interchangeable (e.g. GPUs of one machine).
    """
    dp = np.round(costs.data_parallel_s, 9)
    pp = np.round(costs.pipeline_s, 9)
    count = costs.num_devices
    colours = np.zeros(count, dtype=np.int64)
    colour_count = 1
    for _ in range(REFINEMENT_ROUNDS):
        signatures = [
            (int(colours[d]), tuple(sorted(zip(colours.tolist(), dp[d].tolist(), pp[d].tolist()))))
            for d in range(count)
        ]
        distinct = sorted(set(signatures))
        rank = {signature: index for index, signature in enumerate(distinct)}
        colours = np.array([rank[s] for s in signatures], dtype=np.int64)
        if len(distinct) == colour_count or len(distinct) == count:
            break  # stable, or every device already has its own colour
        colour_count = len(distinct)
    return np.lexsort((np.arange(count), colours))


class _Evaluator:
    """Scores ordered partitions and batches of swaps in canonical device numbering."""

    def __init__(self, dp: np.ndarray, pp: np.ndarray, stages: int, replicas: int) -> None:
        self.dp = dp  # (N, N) s
        self.pp = pp  # (N, N) s
        self.stages = stages
        self.replicas = replicas

    def edge_scores(self, left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bottleneck cost and its relaxation for (C, R) x (C, R) groups -> (C,), (C,)."""
        blocks = self.pp[left[:, :, None], right[:, None, :]]  # (C, R, R)
        relaxed = (blocks.min(axis=2).mean(axis=1) + blocks.min(axis=1).mean(axis=1)) / 2.0
        return bottleneck_assignment_costs(blocks), relaxed

    def score(self, groups: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray, np.ndarray]:
        """(total, secondary, group DATAPs (G,), edges (G-1,), edge relaxations (G-1,))."""
        data = group_data_parallel_costs(self.dp, groups)
        if self.stages > 1:
            edges, relaxed = self.edge_scores(groups[:-1], groups[1:])
        else:
            edges, relaxed = np.zeros(0), np.zeros(0)
        total = float(data.max() + edges.sum())
        secondary = float(data.mean() + relaxed.sum())
        return total, secondary, data, edges, relaxed

    def best_swap(
        self,
        groups: np.ndarray,
        data: np.ndarray,
        edges: np.ndarray,
        relaxed: np.ndarray,
        first: int,
        second: int,
    ) -> tuple[float, float, int, int]:
        """The best of the R*R swaps between groups ``first`` and ``second``.

        Returns (total, secondary, i, j): swap groups[first][i] with groups[second][j].
        """
        replicas = self.replicas
        left, right = groups[first], groups[second]
        # Candidate c = i*R + j swaps left[i] with right[j].
        slot_i = np.repeat(np.arange(replicas), replicas)  # (C,)
        slot_j = np.tile(np.arange(replicas), replicas)  # (C,)
        new_left = np.broadcast_to(left, (replicas * replicas, replicas)).copy()  # (C, R)
        new_left[np.arange(new_left.shape[0]), slot_i] = right[slot_j]
        new_right = np.broadcast_to(right, (replicas * replicas, replicas)).copy()  # (C, R)
        new_right[np.arange(new_right.shape[0]), slot_j] = left[slot_i]

        data_left = group_data_parallel_costs(self.dp, new_left)  # (C,)
        data_right = group_data_parallel_costs(self.dp, new_right)  # (C,)
        others = np.delete(data, [first, second])
        other_max = others.max() if others.size else 0.0
        data_max = np.maximum(np.maximum(data_left, data_right), other_max)
        # Mean, not max, of the groups' DATAP: on a par with one max, but every group counts.
        data_mean = (data.sum() - data[first] - data[second] + data_left + data_right) / self.stages

        replaced = {first: new_left, second: new_right}
        touched = sorted({t for t in (first - 1, first, second - 1, second) if 0 <= t < self.stages - 1})
        path = np.full(new_left.shape[0], edges.sum())
        relax = np.full(new_left.shape[0], relaxed.sum())
        if touched:
            count = new_left.shape[0]
            lefts = [replaced.get(t, np.broadcast_to(groups[t], (count, replicas))) for t in touched]
            rights = [replaced.get(t + 1, np.broadcast_to(groups[t + 1], (count, replicas))) for t in touched]
            cost, soft = self.edge_scores(np.concatenate(lefts), np.concatenate(rights))
            cost = cost.reshape(len(touched), count)
            soft = soft.reshape(len(touched), count)
            path = path - edges[touched].sum() + cost.sum(axis=0)
            relax = relax - relaxed[touched].sum() + soft.sum(axis=0)
        total = data_max + path  # (C,)
        secondary = data_mean + relax  # (C,)
        best = np.lexsort((secondary, np.round(total / TIE_S)))[0]
        return float(total[best]), float(secondary[best]), int(slot_i[best]), int(slot_j[best])


def _better(total: float, secondary: float, than_total: float, than_secondary: float) -> bool:
    if total < than_total - TIE_S:
        return True
    return total <= than_total + TIE_S and secondary < than_secondary - TIE_S


def _local_search(evaluator: _Evaluator, groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Swap and re-order until neither improves (total, secondary); returns ordered groups."""
    groups = groups.copy()
    stages = evaluator.stages
    pairs = [(a, b) for a in range(stages) for b in range(a + 1, stages)]
    total, secondary, data, edges, relaxed = evaluator.score(groups)
    while True:
        improved = False
        for index in rng.permutation(len(pairs)):
            first, second = pairs[index]
            cand_total, cand_secondary, i, j = evaluator.best_swap(groups, data, edges, relaxed, first, second)
            if _better(cand_total, cand_secondary, total, secondary):
                groups[first, i], groups[second, j] = groups[second, j], groups[first, i]
                total, secondary, data, edges, relaxed = evaluator.score(groups)
                improved = True
        if stages > 2:
            path, order = shortest_open_path(pipeline_edge_costs(evaluator.pp, groups))
            if path < edges.sum() - TIE_S:
                groups = groups[order]
                total, secondary, data, edges, relaxed = evaluator.score(groups)
                improved = True
        if not improved:
            return groups


def _greedy_clusters(cost: np.ndarray, count: int, size: int, rng: np.random.Generator) -> list[list[int]]:
    """``count`` clusters of ``size`` devices: grow each from a random seed by cheapest addition."""
    free = list(range(cost.shape[0]))
    clusters = []
    for _ in range(count):
        seed = free[int(rng.integers(len(free)))]
        cluster = [seed]
        free.remove(seed)
        while len(cluster) < size:
            added = cost[np.ix_(free, cluster)].sum(axis=1)  # (F,)
            pick = free[int(np.argmin(added))]
            cluster.append(pick)
            free.remove(pick)
        clusters.append(cluster)
    return clusters


def _clusters_as_groups(evaluator: _Evaluator, rng: np.random.Generator) -> np.ndarray:
    """Megatron-like start: each stage on a tight cluster (cheap averaging)."""
    clusters = _greedy_clusters(evaluator.dp, evaluator.stages, evaluator.replicas, rng)
    return np.array(clusters, dtype=np.int64)


def _clusters_as_pipelines(evaluator: _Evaluator, rng: np.random.Generator) -> np.ndarray:
    """Each replica's whole pipeline on a tight cluster (cheap activations): stage g = g-th hop."""
    chains = _greedy_clusters(evaluator.pp, evaluator.replicas, evaluator.stages, rng)
    ordered = []
    for chain in chains:
        path = [chain[0]]
        left = chain[1:]
        while left:
            nxt = min(left, key=lambda device: (evaluator.pp[path[-1], device], device))
            path.append(nxt)
            left.remove(nxt)
        ordered.append(path)
    return np.array(ordered, dtype=np.int64).T.copy()  # (G, R)


def _grown_pipelines(evaluator: _Evaluator, rng: np.random.Generator) -> np.ndarray:
    """Grow all R pipelines at once, stage by stage, from well-spread heads.

    Heads: devices whose G-1 cheapest pipeline links are cheapest, skipping any device that is
    among the G-1 nearest of a head already taken (so each head can start its own cheap chain).
    Each next stage is the min-sum assignment of the current stage to the free devices.
    """
    pp = evaluator.pp
    stages, replicas = evaluator.stages, evaluator.replicas
    count = pp.shape[0]
    hops = max(1, stages - 1)
    with_self = pp + np.diag(np.full(count, np.inf))  # (N, N) no self links
    nearest = np.argsort(with_self, axis=1, kind="stable")[:, :hops]  # (N, hops)
    score = np.round(np.sort(with_self, axis=1)[:, :hops].sum(axis=1), 9)  # (N,)
    shuffled = rng.permutation(count)
    by_score = shuffled[np.argsort(score[shuffled], kind="stable")]
    heads: list[int] = []
    blocked = np.zeros(count, dtype=bool)
    for device in by_score:
        if not blocked[device]:
            heads.append(int(device))
            blocked[nearest[device]] = True
            blocked[device] = True
        if len(heads) == replicas:
            break
    for device in by_score:  # fewer well-spread heads than replicas: fill with the best left
        if len(heads) == replicas:
            break
        if int(device) not in heads:
            heads.append(int(device))
    stage = np.array(heads, dtype=np.int64)
    free = np.setdiff1d(np.arange(count), stage)
    grown = [stage]
    for _ in range(stages - 1):
        rows, cols = linear_sum_assignment(pp[np.ix_(stage, free)])
        stage = free[cols[np.argsort(rows)]]
        free = np.setdiff1d(free, stage)
        grown.append(stage)
    return np.array(grown, dtype=np.int64)


def _random_partition(evaluator: _Evaluator, rng: np.random.Generator) -> np.ndarray:
    count = evaluator.stages * evaluator.replicas
    return rng.permutation(count).reshape(evaluator.stages, evaluator.replicas)


def _kick(groups: np.ndarray, rng: np.random.Generator, swaps: int) -> np.ndarray:
    """Random swaps of devices between random pairs of groups."""
    kicked = groups.copy()
    stages, replicas = kicked.shape
    for _ in range(swaps):
        first, second = rng.choice(stages, size=2, replace=False)
        i, j = rng.integers(replicas, size=2)
        kicked[first, i], kicked[second, j] = kicked[second, j], kicked[first, i]
    return kicked


def search_plan(
    topology: Topology,
    *,
    seed: int = 0,
    time_limit_s: float = 60.0,
    max_rounds: int | None = None,
    patience_rounds: int | None = DEFAULT_PATIENCE_ROUNDS,
) -> SearchResult:
    """Find a low-cost balanced partition of the topology's devices into pipeline stages.

    Args:
        topology: the network to plan for.
        seed: random seed; the same seed and round budget give the same plan.
        time_limit_s: wall-clock budget; the search stops after the round in progress.
        max_rounds: local searches to run (starts plus kicks); None means no cap.
        patience_rounds: stop after this many rounds without a better plan; None means no cap.

    Returns:
        The best plan found, groups in original device numbering and pipeline order.

    Raises:
        ValueError: a non-positive time limit, round budget or patience.
    """
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds must be at least 1, got {max_rounds}")
    if patience_rounds is not None and patience_rounds < 1:
        raise ValueError(f"patience_rounds must be at least 1, got {patience_rounds}")
    started = time.perf_counter()
    costs = pair_costs(topology)
    canon = canonical_device_order(costs)  # (N,) canonical index -> original device
    evaluator = _Evaluator(
        costs.data_parallel_s[np.ix_(canon, canon)],
        costs.pipeline_s[np.ix_(canon, canon)],
        topology.stages,
        topology.replicas,
    )
    rng = np.random.default_rng(seed)
    builders = [_grown_pipelines, _clusters_as_pipelines, _clusters_as_groups, _random_partition]

    best_groups: np.ndarray | None = None
    best_key = (np.inf, np.inf)
    current = None
    current_key = (np.inf, np.inf)
    rounds = 0
    best_found_s = 0.0
    stopped_by_time = False
    kick_max = max(2, topology.num_devices // 8)
    last_improved = 0
    while max_rounds is None or rounds < max_rounds:
        if patience_rounds is not None and rounds - last_improved >= patience_rounds:
            break
        if best_groups is not None and time.perf_counter() - started >= time_limit_s:
            stopped_by_time = True
            break
        if rounds < 2 * len(builders) or current is None or rounds % RESTART_EVERY == 0:
            start = builders[rounds % len(builders)](evaluator, rng)
        else:
            start = _kick(current, rng, int(rng.integers(2, kick_max + 1)))
        groups = _local_search(evaluator, start, rng)
        total, secondary, *_ = evaluator.score(groups)
        rounds += 1
        if _better(total, secondary, *best_key):
            best_groups, best_key = groups, (total, secondary)
            best_found_s = time.perf_counter() - started
            last_improved = rounds
        # Accept equal-or-better states so kicks drift across plateaus.
        if current is None or total <= current_key[0] + TIE_S:
            current, current_key = groups, (total, secondary)
        if rounds == 2 * len(builders):
            current, current_key = best_groups, best_key

    assert best_groups is not None
    original = canon[best_groups]  # (G, R) original device indices
    cost = evaluate_plan(costs, original)
    ordered = np.sort(original[list(cost.order)], axis=1)  # (G, R) in pipeline order
    final = PlanCost(cost.data_parallel_s, cost.pipeline_s, cost.total_s, tuple(range(len(ordered))))
    return SearchResult(
        groups=ordered,
        cost=final,
        seed=seed,
        elapsed_s=time.perf_counter() - started,
        rounds=rounds,
        best_found_s=best_found_s,
        stopped_by_time=stopped_by_time,
    )
