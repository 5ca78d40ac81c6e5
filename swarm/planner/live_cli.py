"""``swarm plan --from-dht``: plan for the peers that are running, from the links they measured.

Reads every peer's `LinkRecord` (dht/link_records.py) from the DHT, builds the topology
(live_topology.py: symmetrised, missing pairs estimated conservatively and reported), runs the same
search as ``swarm plan --topology``, prints the plan with peer ids, writes it with ``--out``, and
with ``--publish`` stores it as a `PlanRecord` (dht/plan_record.py) that peers can follow.

The transfer sizes of the cost model come from ``--c-pp-gb``/``--c-dp-gb``, else from a
``--profile``, else from the model's shapes (fp32 activations and gradients of the equal split).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import numpy as np

from process.config import ConfigError, add_config_arguments, from_sources

__all__ = ["add_live_arguments", "run_live_plan", "DEFAULT_MACRO_BATCH_SAMPLES"]

DEFAULT_MACRO_BATCH_SAMPLES = 32


def add_live_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--from-dht`` options (and the DHT network options, with their SWARM_* env vars)."""
    from dht.node import NetworkConfig

    live = parser.add_argument_group("planning for a running swarm (--from-dht)")
    live.add_argument(
        "--from-dht",
        action="store_true",
        help="plan for the peers on the DHT from the links they measured (instead of --topology)",
    )
    live.add_argument("--model", default="small", help="model whose peers to plan for (default small)")
    live.add_argument(
        "--stages", type=int, metavar="S", help="pipeline stages (default: the stage count most peers serve)"
    )
    live.add_argument(
        "--c-pp-gb",
        type=float,
        help="activation GB one stage sends the next per macro-batch "
        "(default: from --profile, else from the model's shapes and --macro-batch-samples)",
    )
    live.add_argument(
        "--c-dp-gb",
        type=float,
        help="gradient GB a stage's replicas average "
        "(default: from --profile, else fp32 gradients of the largest stage of the model)",
    )
    live.add_argument(
        "--max-link-age-s", type=float, default=600.0, help="ignore link measurements older than this (default 600)"
    )
    live.add_argument("--publish", action="store_true", help="store the plan on the DHT for peers to follow")
    live.add_argument(
        "--plan-ttl-s",
        type=float,
        default=3600.0,
        help="with --publish: the plan expires after this many seconds (default 3600)",
    )
    live.add_argument(
        "--save-topology",
        type=Path,
        metavar="FILE.json",
        help="also write the measured topology as a topology file (replay with --topology)",
    )
    add_config_arguments(live, NetworkConfig)


def _most_common_num_stages(records) -> int:
    counts = collections.Counter(record.num_stages for record in records)
    return max(counts, key=lambda n: (counts[n], n))


def _sizes(args: argparse.Namespace, stages: int) -> tuple[float, float]:
    """(c_pp_gb, c_dp_gb) for the cost model; raises TopologyError/ProfileError/ValueError."""
    from models.config import get_model_config
    from models.layer_costs import ModelProfile
    from models.stages import equal_boundaries
    from swarm.planner.topology import TopologyError
    from swarm.planner.workload import communication_sizes, estimated_communication_sizes

    if args.c_pp_gb is not None and args.c_dp_gb is not None:
        return _checked_sizes(args.c_pp_gb, args.c_dp_gb)
    samples = args.macro_batch_samples if args.macro_batch_samples is not None else DEFAULT_MACRO_BATCH_SAMPLES
    if samples < 1:
        raise TopologyError("--macro-batch-samples must be at least 1")
    if not args.activation_wire_ratio > 0:
        raise TopologyError("--activation-wire-ratio must be positive")
    if args.profile is not None:
        profile = ModelProfile.read(args.profile)
        sizes = communication_sizes(
            profile,
            equal_boundaries(profile.n_layers, stages),
            samples_per_macro_batch=samples,
            activation_wire_ratio=args.activation_wire_ratio,
        )
    else:
        config = get_model_config(args.model)
        if stages > config.n_layers:
            raise TopologyError(
                f"{args.model} has {config.n_layers} blocks: it cannot be split into {stages} stages "
                f"(give --c-pp-gb and --c-dp-gb to plan with other sizes)"
            )
        sizes = estimated_communication_sizes(
            config,
            equal_boundaries(config.n_layers, stages),
            samples_per_macro_batch=samples,
            activation_wire_ratio=args.activation_wire_ratio,
        )
    c_pp = args.c_pp_gb if args.c_pp_gb is not None else max(sizes.c_pp_gb, default=0.0) or 1e-9
    c_dp = args.c_dp_gb if args.c_dp_gb is not None else max(sizes.c_dp_gb)
    return _checked_sizes(c_pp, c_dp)


def _checked_sizes(c_pp: float, c_dp: float) -> tuple[float, float]:
    from swarm.planner.topology import TopologyError

    for name, value in (("--c-pp-gb", c_pp), ("--c-dp-gb", c_dp)):
        if not (np.isfinite(value) and value > 0):
            raise TopologyError(f"{name} must be positive, got {value}")
    return float(c_pp), float(c_dp)


def topology_file_record(topology) -> dict[str, Any]:
    """A topology in the file format `load_topology` reads (latency in ms; diagonal 0)."""
    latency_ms = topology.latency_s * 1e3
    bandwidth = np.where(np.isfinite(topology.bandwidth_gbps), topology.bandwidth_gbps, 0.0)
    return {
        "name": topology.name,
        "stages": topology.stages,
        "replicas": topology.replicas,
        "c_dp_gb": topology.c_dp_gb,
        "c_pp_gb": topology.c_pp_gb,
        "latency_ms": latency_ms.tolist(),
        "bandwidth_gbps": bandwidth.tolist(),
    }


def run_live_plan(args: argparse.Namespace, fail, write_json) -> int:
    """Plan from the DHT; ``fail(message) -> exit code`` reports a user error, ``write_json(path,
    record)`` writes a file atomically. Returns the exit code."""
    from hivemind.utils import get_dht_time

    from dht.link_records import fetch_link_records
    from dht.node import BootstrapError, NetworkConfig, start_dht
    from dht.plan_record import PlanRecord, publish_plan
    from models.config import UnknownModelError
    from models.layer_costs import ProfileError
    from swarm.planner.live_topology import topology_from_link_records
    from swarm.planner.opfence import opfence_plan
    from swarm.planner.plan_json import opfence_record, plan_record
    from swarm.planner.search import search_plan
    from swarm.planner.topology import TopologyError

    if args.stages is not None and args.stages < 1:
        return fail(f"--stages must be at least 1, got {args.stages}")
    if not args.plan_ttl_s > 0 or not args.max_link_age_s > 0:
        return fail("--plan-ttl-s and --max-link-age-s must be positive")
    try:
        network = from_sources(NetworkConfig, args)
    except ConfigError as error:
        return fail(str(error))
    if not network.initial_peers:
        return fail("--from-dht needs --initial-peers (or SWARM_INITIAL_PEERS): a multiaddr of a running DHT node")
    try:
        dht = start_dht(network, client_mode=True)
    except BootstrapError as error:
        return fail(str(error))
    try:
        try:
            records = fetch_link_records(dht, args.model, timeout_s=network.startup_timeout_s)
        except TimeoutError:
            return fail(f"the DHT did not answer within {network.startup_timeout_s} s")
        if not records:
            return fail(
                f"no peer of {args.model} has published link records yet (peers publish them after their "
                f"first probe round; is --link-probe-period-s 0 on them?)"
            )
        stages = args.stages or _most_common_num_stages(records)
        try:
            c_pp_gb, c_dp_gb = _sizes(args, stages)
            live = topology_from_link_records(
                records,
                stages=stages,
                c_dp_gb=c_dp_gb,
                c_pp_gb=c_pp_gb,
                now=get_dht_time(),
                max_link_age_s=args.max_link_age_s,
                name=f"{args.model} swarm, measured",
            )
        except (TopologyError, ProfileError, UnknownModelError, ValueError) as error:
            return fail(str(error))
        topology = live.topology
        print(f"topology: {live.describe()}", flush=True)
        if args.method == "opfence":
            result = opfence_plan(topology, placement=args.placement)
            record = opfence_record(topology, result)
        else:
            result = search_plan(
                topology, seed=args.seed, time_limit_s=args.time_limit_s, patience_rounds=args.patience_rounds
            )
            record = plan_record(topology, result, args.time_limit_s)
        stage_peers = [[live.peer_ids[int(device)] for device in group] for group in result.groups]
        record.update(
            model=args.model,
            c_pp_gb=c_pp_gb,
            c_dp_gb=c_dp_gb,
            peers=list(live.peer_ids),
            stage_peers=stage_peers,
            spares=list(live.spares),
            measured_pairs=live.measured_pairs,
            one_way_pairs=live.one_way_pairs,
            estimated_pairs=[list(pair) for pair in live.estimated_pairs],
        )
        cost = result.cost
        print(
            f"plan for {len(live.peer_ids)} peers of {args.model} in {stages} stages: total {cost.total_s:.4f} s "
            f"(data parallel {cost.data_parallel_s:.4f} s + pipeline {cost.pipeline_s:.4f} s)",
            flush=True,
        )
        for stage, peers in enumerate(stage_peers):
            print(f"  stage {stage}: {' '.join(peers)}", flush=True)
        if live.spares:
            print(f"  spares: {' '.join(live.spares)}", flush=True)
        for path, content in (
            (args.out, record),
            (args.save_topology, topology_file_record(topology) if args.save_topology else None),
        ):
            if path is None:
                continue
            try:
                write_json(path, content)
            except OSError as error:
                return fail(f"cannot write {str(path)!r}: {error.strerror or error}")
            print(f"wrote {path}", flush=True)
        if args.publish:
            now = get_dht_time()
            plan = PlanRecord(
                model=args.model,
                num_stages=stages,
                stages=tuple(tuple(p) for p in stage_peers),
                spares=live.spares,
                total_s=cost.total_s,
                data_parallel_s=cost.data_parallel_s,
                pipeline_s=cost.pipeline_s,
                planner_id=dht.peer_id.to_base58(),
                created_at=now,
                expires_at=now + args.plan_ttl_s,
            )
            if not publish_plan(dht, plan, timeout_s=network.startup_timeout_s):
                return fail("could not store the plan on the DHT (no node accepted it in time)")
            print(f"published the plan on the DHT (expires in {args.plan_ttl_s:.0f} s)", flush=True)
        return 0
    finally:
        dht.shutdown()
