"""``swarm plan``: compute a placement plan from a topology file and write it as JSON.

Usable as a subcommand (``add_plan_arguments`` + ``run_plan``) or standalone:
``python -m swarm.planner.plan_cli --topology FILE.json --out PLAN.json [--seed S] [--time-limit-s T]``.
The plan file holds ``groups`` (device indices per stage, in pipeline order) and ``cost``
(``data_parallel_s``, ``pipeline_s``, ``total_s``), with the seed and search time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from swarm.planner.search import DEFAULT_PATIENCE_ROUNDS, SearchResult, search_plan
from swarm.planner.topology import Topology, TopologyError, load_topology

__all__ = ["add_plan_arguments", "run_plan", "plan_record", "main"]

EXIT_OK = 0
EXIT_USAGE = 2


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` options to a parser (a subcommand's or a standalone one)."""
    parser.add_argument(
        "--topology", required=True, type=Path, metavar="FILE.json",
        help="topology JSON: stages, replicas, c_dp_gb, c_pp_gb, latency_ms, bandwidth_gbps",
    )
    parser.add_argument(
        "--out", required=True, type=Path, metavar="PLAN.json", help="where to write the plan"
    )
    parser.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    parser.add_argument(
        "--time-limit-s", type=float, default=60.0,
        help="wall-clock cap on the search in seconds (default 60)",
    )
    parser.add_argument(
        "--patience-rounds", type=int, default=DEFAULT_PATIENCE_ROUNDS,
        help=f"stop after this many rounds without improvement (default {DEFAULT_PATIENCE_ROUNDS})",
    )


def plan_record(topology: Topology, result: SearchResult, time_limit_s: float) -> dict[str, Any]:
    """The JSON-ready plan: groups in pipeline order, cost in seconds, how it was searched."""
    return {
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


def _write_json_atomically(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(record, stream, indent=1)
            stream.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _fail(message: str) -> int:
    print(f"swarm plan: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_plan(args: argparse.Namespace) -> int:
    """Plan for ``args.topology`` and write ``args.out``; 0 on success, 2 on a bad input."""
    if not args.time_limit_s > 0:
        return _fail(f"--time-limit-s must be positive, got {args.time_limit_s}")
    if args.seed < 0:
        return _fail(f"--seed must be non-negative, got {args.seed}")
    if args.patience_rounds is not None and args.patience_rounds < 1:
        return _fail(f"--patience-rounds must be at least 1, got {args.patience_rounds}")
    try:
        topology = load_topology(args.topology)
    except TopologyError as error:
        return _fail(str(error))
    result = search_plan(
        topology,
        seed=args.seed,
        time_limit_s=args.time_limit_s,
        patience_rounds=args.patience_rounds,
    )
    record = plan_record(topology, result, args.time_limit_s)
    try:
        _write_json_atomically(args.out, record)
    except OSError as error:
        return _fail(f"cannot write plan to {str(args.out)!r}: {error.strerror or error}")
    print(
        f"plan for {topology.name or args.topology}: total {result.cost.total_s:.2f} s "
        f"(data parallel {result.cost.data_parallel_s:.2f} s + pipeline "
        f"{result.cost.pipeline_s:.2f} s), searched {result.elapsed_s:.1f} s -> {args.out}"
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m swarm.planner.plan_cli``."""
    parser = argparse.ArgumentParser(
        prog="python -m swarm.planner.plan_cli",
        description="Place pipeline stages on devices to minimise DT-FM communication cost.",
    )
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
