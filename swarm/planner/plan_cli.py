"""``swarm plan``: compute a placement plan from a topology file and write it as JSON.

Usable as a subcommand (``add_plan_arguments`` + ``run_plan``) or standalone:
``python -m swarm.planner.plan_cli --topology FILE.json --out PLAN.json [--seed S] [--time-limit-s T]``.
The plan file holds ``groups`` (device indices per stage, in pipeline order) and ``cost``
(``data_parallel_s``, ``pipeline_s``, ``total_s``), with the seed and search time.

``--method opfence`` places by bandwidth clusters instead of searching (``opfence.py``);
``--profile PROFILE.json --macro-batch-samples N [--split-boundaries 0,4,6]`` takes ``c_pp`` and
``c_dp`` from a ``swarm profile`` measurement instead of the topology file's constants.
``--from-dht --initial-peers MADDR [--stages S] [--out PLAN.json] [--publish]`` plans for the
peers of a running swarm from the links they measured (``live_cli.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from models.layer_costs import ModelProfile, ProfileError
from swarm.planner.live_cli import add_live_arguments, run_live_plan
from swarm.planner.opfence import PLACEMENTS, opfence_plan
from swarm.planner.plan_json import opfence_record, plan_record
from swarm.planner.search import DEFAULT_PATIENCE_ROUNDS, search_plan
from swarm.planner.topology import Topology, TopologyError, load_topology

__all__ = ["add_plan_arguments", "run_plan", "plan_record", "main"]

EXIT_OK = 0
EXIT_USAGE = 2


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` options to a parser (a subcommand's or a standalone one)."""
    parser.add_argument(
        "--topology",
        type=Path,
        metavar="FILE.json",
        help="topology JSON: stages, replicas, c_dp_gb, c_pp_gb, latency_ms, bandwidth_gbps "
        "(or --from-dht to plan for a running swarm)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="PLAN.json",
        help="where to write the plan (required with --topology, optional with --from-dht)",
    )
    parser.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=60.0,
        help="wall-clock cap on the search in seconds (default 60)",
    )
    parser.add_argument(
        "--patience-rounds",
        type=int,
        default=DEFAULT_PATIENCE_ROUNDS,
        help=f"stop after this many rounds without improvement (default {DEFAULT_PATIENCE_ROUNDS})",
    )
    parser.add_argument(
        "--method",
        choices=["search", "opfence"],
        default="search",
        help="search: iterated local search (default); opfence: cluster devices by bandwidth, "
        "place whole stages or pipelines in the fastest clusters (no search)",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="best",
        help="with --method opfence: keep whole stages or whole pipelines in clusters, or the "
        "cheaper of both (default best)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="PROFILE.json",
        help="take c_pp and c_dp from this `swarm profile` output instead of the topology file",
    )
    parser.add_argument(
        "--split-boundaries",
        metavar="0,4,6",
        help="with --profile: the stage split (default: the equal split into the topology's stages)",
    )
    parser.add_argument(
        "--macro-batch-samples",
        type=int,
        metavar="N",
        help="with --profile or --from-dht: samples each pipeline replica processes per macro-batch "
        "(--from-dht default: 32)",
    )
    parser.add_argument(
        "--activation-wire-ratio",
        type=float,
        default=1.0,
        help="with --profile: wire bytes per measured activation byte (0.5 for fp16; default 1)",
    )
    add_live_arguments(parser)


def _topology_with_profile(topology: Topology, args: argparse.Namespace) -> Topology:
    """The topology with c_pp and c_dp from ``args.profile``; raises TopologyError or ProfileError."""
    from models.stages import StageSplitError, equal_boundaries
    from swarm.planner.workload import communication_sizes, with_communication_sizes

    if args.macro_batch_samples is None or args.macro_batch_samples < 1:
        raise TopologyError("--profile needs --macro-batch-samples N (N >= 1)")
    if not args.activation_wire_ratio > 0:
        raise TopologyError("--activation-wire-ratio must be positive")
    profile = ModelProfile.read(args.profile)
    try:
        if args.split_boundaries:
            boundaries = tuple(int(part) for part in args.split_boundaries.split(","))
        else:
            boundaries = equal_boundaries(profile.n_layers, topology.stages)
    except StageSplitError as error:  # (a ValueError too: caught first)
        raise TopologyError(f"{error} (the topology has {topology.stages} stages)") from None
    except ValueError:
        raise TopologyError(f"--split-boundaries {args.split_boundaries!r}: expected e.g. 0,4,6") from None
    sizes = communication_sizes(
        profile,
        boundaries,
        samples_per_macro_batch=args.macro_batch_samples,
        activation_wire_ratio=args.activation_wire_ratio,
    )
    return with_communication_sizes(topology, sizes)


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
    if getattr(args, "from_dht", False):
        if args.topology is not None:
            return _fail("give either --topology or --from-dht, not both")
        return run_live_plan(args, _fail, _write_json_atomically)
    if args.topology is None or args.out is None:
        return _fail("--topology FILE.json and --out PLAN.json are required (or plan a running swarm with --from-dht)")
    try:
        topology = load_topology(args.topology)
        if getattr(args, "profile", None) is not None:
            topology = _topology_with_profile(topology, args)
    except (TopologyError, ProfileError) as error:
        return _fail(str(error))
    if getattr(args, "method", "search") == "opfence":
        result = opfence_plan(topology, placement=args.placement)
        return _write_and_report(args, topology, opfence_record(topology, result), result.cost, result.elapsed_s)
    result = search_plan(
        topology,
        seed=args.seed,
        time_limit_s=args.time_limit_s,
        patience_rounds=args.patience_rounds,
    )
    record = plan_record(topology, result, args.time_limit_s)
    return _write_and_report(args, topology, record, result.cost, result.elapsed_s)


def _write_and_report(
    args: argparse.Namespace, topology: Topology, record: dict[str, Any], cost, elapsed_s: float
) -> int:
    record["c_pp_gb"], record["c_dp_gb"] = topology.c_pp_gb, topology.c_dp_gb
    try:
        _write_json_atomically(args.out, record)
    except OSError as error:
        return _fail(f"cannot write plan to {str(args.out)!r}: {error.strerror or error}")
    print(
        f"plan for {topology.name or args.topology}: total {cost.total_s:.2f} s "
        f"(data parallel {cost.data_parallel_s:.2f} s + pipeline "
        f"{cost.pipeline_s:.2f} s), searched {elapsed_s:.1f} s -> {args.out}"
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
