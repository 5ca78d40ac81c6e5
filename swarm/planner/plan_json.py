"""A plan as the JSON that `swarm plan` writes and `--publish` stores: one shape for both methods
(the DT-FM search and OP-Fence), groups in pipeline order and the cost model's seconds."""

from __future__ import annotations

from typing import Any

from swarm.planner.opfence import OpFenceResult
from swarm.planner.search import SearchResult
from swarm.planner.topology import Topology


def plan_record(topology: Topology, result: SearchResult, time_limit_s: float) -> dict[str, Any]:
    """The JSON-ready plan: groups in pipeline order, cost in seconds, how it was searched."""
    return {
        "method": "search",
        "topology": topology.name,
        "stages": topology.stages,
        "replicas": topology.replicas,
        "groups": [[int(device) for device in group] for group in result.groups],
        "cost": {
            "data_parallel_s": result.cost.data_parallel_s,
            "pipeline_s": result.cost.pipeline_s,
            "total_s": result.cost.total_s,
        },
        "seed": result.seed,
        "search_time_s": result.elapsed_s,
        "search_rounds": result.rounds,
        "time_limit_s": time_limit_s,
        "stopped_by_time": result.stopped_by_time,
    }


def opfence_record(topology: Topology, result: OpFenceResult) -> dict[str, Any]:
    """The JSON-ready OP-Fence plan, in the same shape as `plan_record`'s."""
    return {
        "method": "opfence",
        "topology": topology.name,
        "stages": topology.stages,
        "replicas": topology.replicas,
        "groups": [[int(device) for device in group] for group in result.groups],
        "cost": {
            "data_parallel_s": result.cost.data_parallel_s,
            "pipeline_s": result.cost.pipeline_s,
            "total_s": result.cost.total_s,
        },
        "placement": result.placement,
        "unit_levels_gbps": list(result.unit_levels_gbps),
        "search_time_s": result.elapsed_s,
    }
