"""Offline placement planner for pipeline + data parallel training (issue #8).

Given pairwise latency and bandwidth between ``stages * replicas`` devices, choose which devices
serve each pipeline stage so that the DT-FM communication cost (Yuan et al., 2022) is low.
Pure numpy/scipy; the only I/O is in ``plan_cli`` and ``live_cli`` (``swarm plan --from-dht``,
which builds the topology from links the peers measured: ``live_topology``).
"""

from swarm.planner.cost import PairCosts, PlanCost, evaluate_plan, pair_costs
from swarm.planner.search import SearchResult, search_plan
from swarm.planner.topology import Topology, TopologyError, load_topology, topology_from_dict

__all__ = [
    "PairCosts",
    "PlanCost",
    "SearchResult",
    "Topology",
    "TopologyError",
    "evaluate_plan",
    "load_topology",
    "pair_costs",
    "search_plan",
    "topology_from_dict",
]
