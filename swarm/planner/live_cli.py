"""``swarm plan --from-dht``: plan for the peers that are running, from the links they measured.

Reads every peer's `LinkRecord` (dht/link_records.py) from the DHT, builds the topology
(live_topology.py: symmetrised, missing pairs estimated conservatively and reported), runs the same
search as ``swarm plan --topology``, prints the plan with peer ids, writes it with ``--out``, and
with ``--publish`` stores it as a `PlanRecord` (dht/plan_record.py) that peers can follow.

The transfer sizes of the cost model come from ``--c-pp-gb``/``--c-dp-gb``, else from a
``--profile``, else from the model's shapes (fp32 activations and gradients of the equal split).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from swarm.planner.plan_config import PlanConfig

__all__ = ["run_live_plan", "DEFAULT_MACRO_BATCH_SAMPLES"]

DEFAULT_MACRO_BATCH_SAMPLES = 32


def _most_common_num_stages(records) -> int:
    counts = collections.Counter(record.num_stages for record in records)
    return max(counts, key=lambda n: (counts[n], n))


def _sizes(config: PlanConfig, stages: int) -> tuple[float, float]:
    """(c_pp_gb, c_dp_gb) for the cost model; raises TopologyError/ProfileError/ValueError."""
    from models.config import get_model_config
    from models.layer_costs import ModelProfile
    from models.stages import equal_boundaries
    from swarm.planner.topology import TopologyError
    from swarm.planner.workload import communication_sizes, estimated_communication_sizes

    live, workload = config.live, config.workload
    if live.c_pp_gb is not None and live.c_dp_gb is not None:
        return _checked_sizes(live.c_pp_gb, live.c_dp_gb)
    samples = workload.macro_batch_samples if workload.macro_batch_samples is not None else DEFAULT_MACRO_BATCH_SAMPLES
    if workload.profile is not None:
        profile = ModelProfile.read(workload.profile)
        sizes = communication_sizes(
            profile,
            equal_boundaries(profile.n_layers, stages),
            samples_per_macro_batch=samples,
            activation_wire_ratio=workload.activation_wire_ratio,
        )
    else:
        model = get_model_config(live.model)
        if stages > model.n_layers:
            raise TopologyError(
                f"{live.model} has {model.n_layers} blocks: it cannot be split into {stages} stages "
                f"(give --c-pp-gb and --c-dp-gb to plan with other sizes)"
            )
        sizes = estimated_communication_sizes(
            model,
            equal_boundaries(model.n_layers, stages),
            samples_per_macro_batch=samples,
            activation_wire_ratio=workload.activation_wire_ratio,
        )
    c_pp = live.c_pp_gb if live.c_pp_gb is not None else max(sizes.c_pp_gb, default=0.0) or 1e-9
    c_dp = live.c_dp_gb if live.c_dp_gb is not None else max(sizes.c_dp_gb)
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


def run_live_plan(config: PlanConfig, fail, write_json) -> int:
    """Plan from the DHT; ``fail(message) -> exit code`` reports a user error, ``write_json(path,
    record)`` writes a file atomically. Returns the exit code."""
    from hivemind.utils import get_dht_time

    from dht.announce import fetch_stage_records
    from dht.link_records import fetch_link_records
    from dht.node import BootstrapError, start_dht
    from dht.plan_record import PlanRecord, publish_plan
    from models.config import UnknownModelError
    from models.layer_costs import ProfileError
    from swarm.planner.live_topology import departed_peers, topology_from_link_records
    from swarm.planner.opfence import opfence_plan
    from swarm.planner.plan_json import opfence_record, plan_record
    from swarm.planner.search import search_plan
    from swarm.planner.topology import TopologyError

    options, search = config.live, config.search
    network = options.network
    try:
        dht = start_dht(network, client_mode=True, models=[options.model])
    except BootstrapError as error:
        return fail(str(error))
    try:
        try:
            records = fetch_link_records(dht, options.model, timeout_s=network.startup_timeout_s)
        except TimeoutError:
            return fail(f"the DHT did not answer within {network.startup_timeout_s} s")
        if not records:
            return fail(
                f"no peer of {options.model} has published link records yet (peers publish them after their "
                f"first probe round; is --link-probe-period-s 0 on them?)"
            )
        stages = options.stages or _most_common_num_stages(records)
        peer_records = [r for stage in range(stages) for r in fetch_stage_records(dht, options.model, stage)]
        departed = departed_peers(sorted({r.peer_id for r in records}), peer_records)
        for peer_id, why in sorted(departed.items()):
            print(f"left out {peer_id}: {why}", flush=True)
        records = [r for r in records if r.peer_id not in departed]
        if not records:
            return fail(f"every peer of {options.model} that published links has left; start peers, then plan again")
        try:
            c_pp_gb, c_dp_gb = _sizes(config, stages)
            live = topology_from_link_records(
                records,
                stages=stages,
                c_dp_gb=c_dp_gb,
                c_pp_gb=c_pp_gb,
                now=get_dht_time(),
                max_link_age_s=options.max_link_age_s,
                name=f"{options.model} swarm, measured",
            )
        except (TopologyError, ProfileError, UnknownModelError, ValueError) as error:
            return fail(str(error))
        topology = live.topology
        print(f"topology: {live.describe()}", flush=True)
        if search.method == "opfence":
            result = opfence_plan(topology, placement=search.placement)
            record = opfence_record(topology, result)
        else:
            result = search_plan(
                topology, seed=search.seed, time_limit_s=search.time_limit_s, patience_rounds=search.patience_rounds
            )
            record = plan_record(topology, result, search.time_limit_s)
        stage_peers = [[live.peer_ids[int(device)] for device in group] for group in result.groups]
        record.update(
            model=options.model,
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
            f"plan for {len(live.peer_ids)} peers of {options.model} in {stages} stages"
            f"{f' (+ {len(live.spares)} spares)' if live.spares else ''}: total {cost.total_s:.4f} s "
            f"(data parallel {cost.data_parallel_s:.4f} s + pipeline {cost.pipeline_s:.4f} s)",
            flush=True,
        )
        for stage, peers in enumerate(stage_peers):
            print(f"  stage {stage}: {' '.join(peers)}", flush=True)
        if live.spares:
            print(f"  spares: {' '.join(live.spares)}", flush=True)
        for path, content in (
            (config.out, record),
            (options.save_topology, topology_file_record(topology) if options.save_topology else None),
        ):
            if path is None:
                continue
            try:
                write_json(path, content)
            except OSError as error:
                return fail(f"cannot write {str(path)!r}: {error.strerror or error}")
            print(f"wrote {path}", flush=True)
        if options.publish:
            now = get_dht_time()
            plan = PlanRecord(
                model=options.model,
                num_stages=stages,
                stages=tuple(tuple(p) for p in stage_peers),
                spares=live.spares,
                total_s=cost.total_s,
                data_parallel_s=cost.data_parallel_s,
                pipeline_s=cost.pipeline_s,
                planner_id=dht.peer_id.to_base58(),
                created_at=now,
                expires_at=now + options.plan_ttl_s,
            )
            if not publish_plan(dht, plan, timeout_s=network.startup_timeout_s):
                return fail("could not store the plan on the DHT (no node accepted it in time)")
            print(f"published the plan on the DHT (expires in {options.plan_ttl_s:.0f} s)", flush=True)
        return 0
    finally:
        dht.shutdown()
