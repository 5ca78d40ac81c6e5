"""An OP-Fence-style placement (FusionLLM, Tang et al. 2024): cluster devices by bandwidth first,
then place whole units of work inside the fastest clusters that can hold them.

FusionLLM's exact rules are not public; this is our design, in four steps:

1. Bandwidth levels. The distinct link bandwidths, fastest first. At level b a cluster is a
   connected component of the links at least b fast (single linkage): the GPUs of one machine,
   then one data centre or region, ..., at the slowest level every device.
2. Units. ``"stages"`` keeps each stage whole: its ``replicas`` devices (a data-parallel group)
   go in one cluster, so gradient averaging stays on fast links; consecutive stages then fall in
   the same cluster where they can, as the issue asks. ``"pipelines"`` keeps each pipeline replica
   whole: its ``stages`` devices go in one cluster, so activations stay on fast links (what the
   DT-FM paper's best layouts do on its geo-distributed scenarios). ``"best"`` builds both and
   keeps the cheaper under the DT-FM cost model.
3. Packing. Level by level, fastest first, every cluster takes as many whole units as its free
   devices hold; devices left over wait for a slower level, where clusters merge. A unit is grown
   inside its cluster from the free device with the cheapest links: a stage adds the device with
   the cheapest links to the group so far, a pipeline the device nearest to its last stage.
4. Order. The groups are put in pipeline order by the exact open-path solver (``cost.py``).

No search and no randomness: deterministic, and milliseconds where ``search.py`` takes seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from swarm.planner.cost import PairCosts, PlanCost, evaluate_plan, pair_costs
from swarm.planner.topology import Topology

__all__ = ["OpFenceResult", "PLACEMENTS", "bandwidth_levels", "clusters_at", "opfence_plan"]

PLACEMENTS = ("stages", "pipelines", "best")


@dataclass(frozen=True)
class OpFenceResult:
    """The plan and how it was built.

    Attributes:
        groups: (G, R) device indices, one row per stage in pipeline order, rows sorted.
        cost: its exact DT-FM cost (order 0..G-1: groups are already in pipeline order).
        placement: "stages" or "pipelines" (the unit kind that was kept).
        unit_levels_gbps: for each unit, the bandwidth level of the cluster it was placed in.
        elapsed_s: wall time.
    """

    groups: np.ndarray
    cost: PlanCost
    placement: str
    unit_levels_gbps: tuple[float, ...]
    elapsed_s: float


def bandwidth_levels(topology: Topology) -> np.ndarray:
    """Distinct off-diagonal link bandwidths, fastest first (Gbit/s)."""
    off_diagonal = ~np.eye(topology.num_devices, dtype=bool)
    return np.unique(topology.bandwidth_gbps[off_diagonal])[::-1]


def clusters_at(topology: Topology, level_gbps: float) -> np.ndarray:
    """(N,) cluster label of each device: components of the links at least `level_gbps` fast."""
    fast = topology.bandwidth_gbps >= level_gbps  # (N, N) bool, diagonal inf -> True
    _, labels = connected_components(csr_matrix(fast), directed=False)
    return labels


def _grow_stage(cost: np.ndarray, free: list[int], size: int) -> list[int]:
    """A data-parallel group: start at the device with the cheapest links, add the cheapest."""
    pool = np.array(free)
    start = int(pool[np.argmin(cost[np.ix_(pool, pool)].sum(axis=1))])
    unit, left = [start], [d for d in free if d != start]
    while len(unit) < size:
        added = cost[np.ix_(left, unit)].sum(axis=1)  # (L,)
        unit.append(left.pop(int(np.argmin(added))))
    return unit


def _grow_pipeline(cost: np.ndarray, free: list[int], size: int) -> list[int]:
    """A pipeline replica: start at the device with the cheapest links, then nearest neighbours."""
    pool = np.array(free)
    start = int(pool[np.argmin(cost[np.ix_(pool, pool)].sum(axis=1))])
    unit, left = [start], [d for d in free if d != start]
    while len(unit) < size:
        unit.append(left.pop(int(np.argmin(cost[unit[-1], left]))))
    return unit


def _pack(topology: Topology, costs: PairCosts, placement: str) -> tuple[np.ndarray, list[float]]:
    """Units packed into the fastest clusters that hold them -> ((G, R) groups, level of each unit)."""
    if placement == "stages":
        unit_size, units_needed, cost, grow = topology.replicas, topology.stages, costs.data_parallel_s, _grow_stage
    else:
        unit_size, units_needed, cost, grow = topology.stages, topology.replicas, costs.pipeline_s, _grow_pipeline
    free = np.ones(topology.num_devices, dtype=bool)
    units: list[list[int]] = []
    levels: list[float] = []
    for level in bandwidth_levels(topology):
        labels = clusters_at(topology, float(level))
        clusters = [np.flatnonzero((labels == label) & free) for label in np.unique(labels)]
        clusters.sort(key=lambda members: (-len(members), members[0] if len(members) else -1))
        for members in clusters:
            members = [int(d) for d in members]
            while len(units) < units_needed and len(members) >= unit_size:
                unit = grow(cost, members, unit_size)
                units.append(unit)
                levels.append(float(level))
                free[unit] = False
                members = [d for d in members if d not in unit]
        if len(units) == units_needed:
            break
    if len(units) != units_needed:  # cannot happen: at the slowest level all devices are one cluster
        raise AssertionError(f"packed {len(units)} of {units_needed} units")
    unit_array = np.array(units, dtype=np.int64)
    groups = unit_array if placement == "stages" else unit_array.T.copy()  # (G, R)
    return groups, levels


def opfence_plan(topology: Topology, *, placement: str = "best") -> OpFenceResult:
    """Cluster by bandwidth, place whole stages (or pipelines) in the fastest clusters, order them.

    Raises:
        ValueError: an unknown placement.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}")
    started = time.perf_counter()
    costs = pair_costs(topology)
    candidates = []
    for kind in ("stages", "pipelines") if placement == "best" else (placement,):
        groups, levels = _pack(topology, costs, kind)
        cost = evaluate_plan(costs, groups)
        candidates.append((cost.total_s, kind, groups, levels, cost))
    total, kind, groups, levels, cost = min(candidates, key=lambda c: c[0])  # ties: "stages", listed first
    ordered = np.sort(groups[list(cost.order)], axis=1)  # (G, R) in pipeline order
    final = PlanCost(cost.data_parallel_s, cost.pipeline_s, cost.total_s, tuple(range(len(ordered))))
    return OpFenceResult(
        groups=ordered,
        cost=final,
        placement=kind,
        unit_levels_gbps=tuple(levels),
        elapsed_s=time.perf_counter() - started,
    )
