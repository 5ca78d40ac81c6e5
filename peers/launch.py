"""Starting a peer: from a `PeerConfig` to a serving `PeerHost`.

The order matters: the metrics endpoint first (a taken port fails fast), then the DHT, the run (its
spec read from the DHT, the effective configuration settled against it once and printed:
peers/settle.py; the first peer of a swarm with no owner publishes its own), the split agreement, the
stage (chosen among those that fit in memory unless given, restored from a checkpoint if there is
one), its throughput measurement, the averager, and finally the host, which runs until
SIGINT/SIGTERM and then announces offline.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Collection

import torch
from hivemind.utils import get_dht_time

from dht.announce import fetch_stage_records
from dht.authority import RunAccess, RunInfo, load_run, load_run_access
from dht.model_match import check_same_model, check_same_vocabulary, describe_foreign, judging_records
from dht.node import protect_models, start_dht, with_p2p_client
from dht.plan_record import fetch_plan, stage_in_plan
from dht.run_specs import SignedSpec, announce_spec, fetch_runs, run_in_force, sign_spec, vouching_peers
from dht.signing import identity_of
from models.hf_format import weight_files
from models.model_source import model_hash
from models.stages import stage_spec
from peers.compute import memory_budget
from peers.compute.devices import check_optimizer, describe_device, resolve_device
from peers.compute.stage_builder import StageBuilder, check_stage_memory
from peers.config import AUTO_STAGE, PeerConfig
from peers.metrics import PeerMetrics
from peers.placement.split_claim import claim_split
from peers.placement.stage_choice import choose_stage, choose_standby_stage
from peers.run_spec import find_run_spec, parse_spec, spec_payload
from peers.serving.host import PeerHost
from peers.serving.run_follower import RunFollower
from peers.settle import SettledPeer, settle
from process.atomic_files import remove_stale_temporaries
from process.config import ConfigError, describe
from process.lifetime import stop_events_in_loop
from process.metrics_http import advertised_metrics_addr, serve_metrics

SPEC_CLAIM_WAIT_S = 1.0  # the first peer of a swarm with no owner: from stating its spec to reading others'


def run_peer(config: PeerConfig, given: Collection[str] = frozenset(), *, verbose: bool = False) -> None:
    """Start the DHT node, join the run, measure the stage, serve until SIGINT/SIGTERM, then announce
    offline. `given`: the options the user set (the others may come from the run's spec)."""
    torch.set_num_threads(config.compute.num_threads)
    device = resolve_device(config.compute.device)
    if config.checkpointing.checkpoint_dir and os.path.isdir(config.checkpointing.checkpoint_dir):
        for path in remove_stale_temporaries(config.checkpointing.checkpoint_dir):  # a killed save's leftovers
            print(f"removed {path}, left by an interrupted checkpoint save", flush=True)
    if config.model_dir:  # no weights, or an unreadable single file: refused before joining anything
        weight_files(config.model_dir)
    if config.init_weights and not os.path.isfile(config.init_weights):
        raise ConfigError(f"--init-weights {config.init_weights!r}: no such file")
    available, source = _memory_available(config, device)
    metrics = PeerMetrics()
    # before the DHT: a taken port fails fast
    endpoint = serve_metrics(metrics.registry, config.metrics.metrics_host, config.metrics.metrics_port)
    metrics_addr = endpoint and advertised_metrics_addr(
        endpoint.host,
        endpoint.port,
        host_maddrs=config.network.host_maddrs,
        announce_maddrs=config.network.announce_maddrs,
    )
    if endpoint:
        print(
            f"metrics on {endpoint.url} (announced as {metrics_addr or 'nothing: no reachable address known'})",
            flush=True,
        )
    named = [config.model] if "model" in given else []
    dht = start_dht(config.network, models=named)
    try:
        peer_id = dht.peer_id.to_base58()
        settled, signed, access = join_run(dht, config, given, device=device, available_bytes=available)
        config, model_config = settled.config, settled.model
        if config.model not in named:  # the model's keys are guarded from now on (dht/record_policy.py)
            protect_models(dht, config.network, [config.model], num_stages=config.num_stages)
        print(
            f"peer {peer_id} starting: {config.model}, stage "
            f"{'auto' if config.stage == AUTO_STAGE else config.stage} of {config.num_stages} "
            f"(--verbose prints the whole configuration)\n{settled.describe()}",
            flush=True,
        )
        if verbose:
            print(describe(config), flush=True)
        print(
            f"device: {describe_device(device)} (--device {config.compute.device}); "
            f"precision {config.compute.precision}; optimizer {config.optim.optimizer}",
            flush=True,
        )
        check_optimizer(config.optim.optimizer, device)
        if config.replicas.averaging == "none":
            print(
                "warning: averaging none: replicas of this stage will train separate, diverging copies "
                "(no one model at the end); leave out --averaging (sync) unless this is an experiment",
                flush=True,
            )
        fitting = _stages_that_fit(settled, available, source, device)
        judged_by = dict(
            authority=access.authority if access else None, credentialed=bool(access and access.credential)
        )
        # Peers of another model under the same name: refused before claiming anything, if this peer is
        # the odd one out; a stranger's record of another model is skipped (dht/model_match.py).
        live = [r for s in range(config.num_stages) for r in fetch_stage_records(dht, config.model, s)]
        check_same_vocabulary(
            live, model_config.vocab_size, model=config.model, who="peer", mine="--vocab-size / model", **judged_by
        )
        foreign = check_same_model(live, model_hash(model_config), model=config.model, who="peer", **judged_by)
        if foreign:
            print(f"warning: {describe_foreign(foreign)}", flush=True)
        # The split is agreed on the DHT before the stage is built: a peer whose split disagrees
        # with the swarm's stops here with a SplitConflictError.
        split = claim_split(
            dht,
            model=config.model,
            peer_id=peer_id,
            requested=settled.boundaries,
            num_stages=config.num_stages,
            n_layers=model_config.n_layers,
            ttl_s=config.announcing.record_ttl_s,
            # in a run, only the claims of the peers whose records judge this one (dht/model_match.py)
            claimants={r.peer_id for r in judging_records(live, **judged_by)} if access else None,
        )
        stage = config.stage if config.stage != AUTO_STAGE else _auto_stage(config, dht, fitting)
        follower = RunFollower(dht, signed, settled.spec)
        builder = StageBuilder(
            config,
            model_config,
            dht,
            split,
            on_averaging_round=metrics.observe_averaging_round,
            device=device,
            available_bytes=available,
            memory_source=source,
            schedule=follower.schedule,
            members_only=access is not None,
        )
        built = builder.build(stage)
        metrics.set_averaging_mode(getattr(built.averaging, "mode", config.replicas.averaging))  # auto: as settled
        if config.faults.enabled:
            print(f"fault injection on: {config.faults}", flush=True)
        # bitsandbytes (int8) is not loaded here: it costs ~2 s of CPU at start, and most runs never
        # ask a peer for int8. The first int8 call pays it once, well inside a call's first timeout.
        runtime, averaging = built.runtime, built.averaging
        asyncio.run(
            _serve_until_signalled(
                PeerHost(
                    config,
                    runtime,
                    dht,
                    averaging,
                    metrics=metrics,
                    metrics_addr=metrics_addr,
                    split=split,
                    builder=builder,
                    run_access=access,
                    follower=follower,
                )
            )
        )
    finally:
        dht.shutdown()
        if endpoint:
            endpoint.close()


def join_run(
    dht, config: PeerConfig, given: Collection[str], *, device: torch.device, available_bytes: int
) -> tuple[SettledPeer, SignedSpec, RunAccess | None]:
    """Find the run this peer joins, settle its configuration against the run's spec, and announce the
    spec it serves; the first peer of a swarm with no owner signs its own settings as the spec. Also
    the run's authority: from --run's file, or from the spec (of a private run, or of the run
    --credential is for)."""
    peer_id = dht.peer_id.to_base58()
    authority = config.authority
    run_file = load_run(authority.run) if authority.run is not None else None
    model = config.model if "model" in given else None
    vouching = vouching_peers(config.network.initial_peers)
    signed = find_run_spec(fetch_runs(dht), authority, model=model, initial_peers=config.network.initial_peers)
    spec = parse_spec(signed) if signed is not None else None
    settled = settle(config, given, spec, device=device, available_bytes=available_bytes, created_at=get_dht_time())
    if settled.made_here:
        signed = sign_spec(identity_of(dht).private_key, spec_payload(settled.spec))
        announce_spec(dht, signed)
        # Another first peer may have stated its settings at the same moment: the earlier claim stands
        # (both apply the same rule to the same records), and this one takes it, or stops. The pause
        # lets a claim made before ours but stored after our read reach the DHT first.
        time.sleep(SPEC_CLAIM_WAIT_S)
        winner = run_in_force(fetch_runs(dht), model=settled.spec.model, vouching=vouching)
        if winner is not None and winner.spec.digest != signed.digest:
            settled = settle(
                config,
                given,
                parse_spec(winner.spec),
                device=device,
                available_bytes=available_bytes,
                created_at=get_dht_time(),
            )
            signed = winner.spec
            announce_spec(dht, signed)
            print(f"joining run {settled.spec.run_id}, started by peer {signed.signer_id[-8:]} just before", flush=True)
    else:
        announce_spec(dht, signed)
    info = run_file
    # from its spec: a private run's authority (it binds every peer), or the run a credential is for
    if info is None and settled.spec.owned and (settled.spec.private or authority.credential is not None):
        info = RunInfo(run_id=settled.spec.run_id, owner_public_key=signed.signer_key, private=settled.spec.private)
    # --run's folder holding the owner key: this process issues itself a credential (dht/authority.py)
    access = load_run_access(authority, peer_id=peer_id, roles=("peer",), run=info)
    return settled, signed, access


def _stages_that_fit(settled: SettledPeer, available: int, source: str, device: torch.device) -> list[int]:
    """The stages this peer can hold (every stage is checked; an explicit --stage only that one).
    None fit: MemoryBudgetError, one line, for the smallest stage."""
    config, model = settled.config, settled.model
    stages = range(config.num_stages) if config.stage == AUTO_STAGE else [config.stage]
    fitting, refusals = [], []
    for stage in stages:
        spec = stage_spec(model, stage, config.num_stages, settled.boundaries)
        try:
            check_stage_memory(config, model, spec, available, source, device)
            fitting.append(stage)
        except memory_budget.MemoryBudgetError as e:
            refusals.append(e)
    if not fitting:
        raise refusals[0]
    return fitting


def _auto_stage(config: PeerConfig, dht, fitting: Collection[int]) -> int:
    """--stage auto / --standby: read every stage's records once and pick (peers/placement/stage_choice.py)."""
    records = [r for s in range(config.num_stages) for r in fetch_stage_records(dht, config.model, s)]
    # A plan published by `swarm plan --from-dht --publish` that names this peer wins over the greedy choice.
    planned = (
        None if config.placement.standby else stage_in_plan(fetch_plan(dht, config.model), dht.peer_id.to_base58())
    )
    if planned is not None and not 0 <= planned < config.num_stages:
        print(
            f"the published plan names stage {planned}, but this swarm has {config.num_stages}: ignoring it", flush=True
        )
        planned = None
    if planned is not None and planned not in fitting:
        print(f"the published plan names stage {planned}, which does not fit in this peer's memory", flush=True)
        planned = None
    if planned is not None:
        print(f"auto: the published plan puts this peer on stage {planned}", flush=True)
    stage = (
        choose_standby_stage(records, config.num_stages)
        if config.placement.standby
        else choose_stage(records, config.num_stages, my_throughput=0.0, planned_stage=planned, fits=fitting)
    )
    fit = "" if len(fitting) == config.num_stages else f"; stages that fit: {', '.join(map(str, fitting))}"
    print(
        f"{'standby for' if config.placement.standby else 'auto: joining'} stage {stage} "
        f"(from {len(records)} records{fit})",
        flush=True,
    )
    return stage


async def _serve_until_signalled(host: PeerHost) -> None:
    """Serve until the first SIGINT/SIGTERM, then stop in order (host.serve); a second one exits at once.
    SIGHUP, the parent-death signal (process/lifetime.py), stops without the goodbyes on the DHT."""
    stop, alone = stop_events_in_loop(
        what="saving the checkpoint, announcing offline, then stopping",
        what_alone="saving the checkpoint, then stopping without the DHT goodbyes",
    )
    await with_p2p_client(host.dht, host.serve(stop, alone))


def _memory_available(config: PeerConfig, device: torch.device) -> tuple[int, str]:
    if config.compute.memory_limit_gb is not None:
        return int(config.compute.memory_limit_gb * memory_budget.GiB), "--memory-limit-gb"
    return memory_budget.available_memory_bytes(device), f"the memory free on {device}"
