"""``swarm plan``: compute a placement plan from a topology file and write it as JSON.

Usable as a subcommand (flags from `PlanConfig`, plan_config.py, + ``run_plan``) or standalone:
``python -m swarm.planner.plan_cli --topology FILE.json --out PLAN.json [--seed S] [--time-limit-s T]``.
Every flag is also a SWARM_* environment variable (``--time-limit-s`` is SWARM_TIME_LIMIT_S).
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
from process.config import ConfigError, add_config_arguments, from_sources
from swarm.planner.live_cli import run_live_plan
from swarm.planner.opfence import opfence_plan
from swarm.planner.plan_config import PlanConfig, WorkloadOptions
from swarm.planner.plan_json import opfence_record, plan_record
from swarm.planner.search import search_plan
from swarm.planner.topology import Topology, TopologyError, load_topology

__all__ = ["PlanConfig", "run_plan", "plan", "plan_record", "main"]

EXIT_OK = 0
EXIT_USAGE = 2


def _topology_with_profile(topology: Topology, workload: WorkloadOptions) -> Topology:
    """The topology with c_pp and c_dp from ``workload.profile``; raises TopologyError or ProfileError."""
    from models.stages import StageSplitError, equal_boundaries
    from swarm.planner.workload import communication_sizes, with_communication_sizes

    if workload.macro_batch_samples is None:
        raise TopologyError("--profile needs --macro-batch-samples N (N >= 1)")
    profile = ModelProfile.read(workload.profile)
    try:
        if workload.split_boundaries:
            boundaries = tuple(int(part) for part in workload.split_boundaries.split(","))
        else:
            boundaries = equal_boundaries(profile.n_layers, topology.stages)
    except StageSplitError as error:  # (a ValueError too: caught first)
        if workload.split_boundaries or profile.n_layers >= topology.stages:
            raise TopologyError(f"{error} (the topology has {topology.stages} stages)") from None
        raise TopologyError(
            f"the profile's model has {profile.n_layers} blocks, fewer than the topology's {topology.stages} stages: "
            f"profile a model of at least {topology.stages} blocks (e.g. swarm profile --model medium, 12 blocks), "
            f"or plan a topology of at most {profile.n_layers} stages"
        ) from None
    except ValueError:
        raise TopologyError(f"--split-boundaries {workload.split_boundaries!r}: expected e.g. 0,4,6") from None
    sizes = communication_sizes(
        profile,
        boundaries,
        samples_per_macro_batch=workload.macro_batch_samples,
        activation_wire_ratio=workload.activation_wire_ratio,
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
    """``swarm plan``: the configuration from ``args`` and SWARM_* variables, then `plan`."""
    try:
        config = from_sources(PlanConfig, args)
    except ConfigError as error:
        return _fail(str(error))
    return plan(config)


def plan(config: PlanConfig) -> int:
    """Plan for ``config.topology`` (or the swarm on the DHT) and write ``config.out``; 0 on
    success, 2 on a bad input."""
    if config.live.from_dht:
        return run_live_plan(config, _fail, _write_json_atomically)
    try:
        topology = load_topology(config.topology)
        if config.workload.profile is not None:
            topology = _topology_with_profile(topology, config.workload)
    except (TopologyError, ProfileError) as error:
        return _fail(str(error))
    search = config.search
    if search.method == "opfence":
        result = opfence_plan(topology, placement=search.placement)
        return _write_and_report(config, topology, opfence_record(topology, result), result.cost, result.elapsed_s)
    result = search_plan(
        topology,
        seed=search.seed,
        time_limit_s=search.time_limit_s,
        patience_rounds=search.patience_rounds,
    )
    record = plan_record(topology, result, search.time_limit_s)
    return _write_and_report(config, topology, record, result.cost, result.elapsed_s)


def _write_and_report(config: PlanConfig, topology: Topology, record: dict[str, Any], cost, elapsed_s: float) -> int:
    record["c_pp_gb"], record["c_dp_gb"] = topology.c_pp_gb, topology.c_dp_gb
    try:
        _write_json_atomically(config.out, record)
    except OSError as error:
        return _fail(f"cannot write plan to {str(config.out)!r}: {error.strerror or error}")
    print(
        f"plan for {topology.name or config.topology}: total {cost.total_s:.2f} s "
        f"(data parallel {cost.data_parallel_s:.2f} s + pipeline "
        f"{cost.pipeline_s:.2f} s), searched {elapsed_s:.1f} s -> {config.out}"
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m swarm.planner.plan_cli``."""
    parser = argparse.ArgumentParser(
        prog="python -m swarm.planner.plan_cli",
        description="Place pipeline stages on devices to minimise DT-FM communication cost.",
    )
    add_config_arguments(parser, PlanConfig)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
