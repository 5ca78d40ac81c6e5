"""Starting a peer: from a `PeerConfig` to a serving `PeerHost`.

The order matters: the metrics endpoint first (a taken port fails fast), then the DHT, the split
agreement, the stage (restored from a checkpoint if there is one), its throughput measurement, the
averager, and finally the host, which runs until SIGINT/SIGTERM and then announces offline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import torch

from dht.announce import fetch_stage_records
from dht.authority import load_run_access
from dht.model_match import check_same_model, check_same_vocabulary, describe_foreign, judging_records
from dht.node import start_dht, with_p2p_client
from dht.plan_record import fetch_plan, stage_in_plan
from models.config import GPTConfig
from models.hf_format import weight_files
from models.model_source import model_hash, resolve_model
from models.stages import stage_spec
from peers.compute import memory_budget
from peers.compute.devices import check_optimizer, describe_device, resolve_device
from peers.compute.stage_builder import StageBuilder, check_stage_memory
from peers.config import AUTO_STAGE, PeerConfig
from peers.metrics import PeerMetrics
from peers.placement.split_claim import claim_split
from peers.placement.stage_choice import choose_stage, choose_standby_stage
from peers.serving.host import PeerHost
from process.atomic_files import remove_stale_temporaries
from process.config import ConfigError
from process.lifetime import stop_events_in_loop
from process.metrics_http import advertised_metrics_addr, serve_metrics


def run_peer(config: PeerConfig) -> None:
    """Start the DHT node, measure the stage, serve until SIGINT/SIGTERM, then announce offline."""
    torch.set_num_threads(config.compute.num_threads)
    model_config = config.subspace.apply(
        dataclasses.replace(
            resolve_model(config.model, config.model_dir, config.vocab_size), trainable=config.trainable
        )
    )
    device = resolve_device(config.compute.device)
    print(
        f"device: {describe_device(device)} (--device {config.compute.device}); "
        f"precision {config.compute.precision}; optimizer {config.optim.optimizer}",
        flush=True,
    )
    check_optimizer(config.optim.optimizer, device)
    if config.checkpointing.checkpoint_dir and os.path.isdir(config.checkpointing.checkpoint_dir):
        for path in remove_stale_temporaries(config.checkpointing.checkpoint_dir):  # a killed save's leftovers
            print(f"removed {path}, left by an interrupted checkpoint save", flush=True)
    if config.model_dir:  # no weights, or an unreadable single file: refused before joining anything
        weight_files(config.model_dir)
    if config.init_weights and not os.path.isfile(config.init_weights):
        raise ConfigError(f"--init-weights {config.init_weights!r}: no such file")
    if config.replicas.averaging == "none":
        print(
            "warning: --averaging none: replicas of this stage will train separate, diverging copies "
            "(no one model at the end); leave out --averaging (sync) unless this is an experiment",
            flush=True,
        )
    available, source = _memory_available(config, device)
    config = _resolve_num_layers(config, model_config, available, device)
    # Refuse before joining anything when the requested stage cannot fit (--stage auto: checked on stage 0
    # here, and again on the stage it picks).
    first_guess = 0 if config.stage == AUTO_STAGE else config.stage
    check_stage_memory(
        config,
        model_config,
        stage_spec(model_config, first_guess, config.num_stages, config.requested_boundaries),
        available,
        source,
        device,
    )
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
    dht = start_dht(config.network, models=[config.model])
    print(
        f"peer {dht.peer_id.to_base58()} starting: {config.model}, stage "
        f"{'auto' if config.stage == AUTO_STAGE else config.stage} of {config.num_stages}, "
        f"averaging {config.replicas.averaging}, checkpoints {config.checkpointing.checkpoint_dir or 'off'} "
        f"(--verbose prints the whole configuration)",
        flush=True,
    )
    try:
        # a wrong, expired or another identity's credential stops the peer here, before the stage is built
        access = load_run_access(config.authority, peer_id=dht.peer_id.to_base58(), roles=("peer",))
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
            peer_id=dht.peer_id.to_base58(),
            requested=config.requested_boundaries,
            num_stages=config.num_stages,
            n_layers=model_config.n_layers,
            ttl_s=config.announcing.record_ttl_s,
            # in a run, only the claims of the peers whose records judge this one (dht/model_match.py)
            claimants={r.peer_id for r in judging_records(live, **judged_by)} if access else None,
        )
        stage = config.stage if config.stage != AUTO_STAGE else _auto_stage(config, dht)
        builder = StageBuilder(
            config,
            model_config,
            dht,
            split,
            on_averaging_round=metrics.observe_averaging_round,
            device=device,
            available_bytes=available,
            memory_source=source,
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
                )
            )
        )
    finally:
        dht.shutdown()
        if endpoint:
            endpoint.close()


def _auto_stage(config: PeerConfig, dht) -> int:
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
    if planned is not None:
        print(f"auto: the published plan puts this peer on stage {planned}", flush=True)
    stage = (
        choose_standby_stage(records, config.num_stages)
        if config.placement.standby
        else choose_stage(records, config.num_stages, my_throughput=0.0, planned_stage=planned)
    )
    print(
        f"{'standby for' if config.placement.standby else 'auto: joining'} stage {stage} (from {len(records)} records)",
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


def _resolve_num_layers(
    config: PeerConfig, model_config: GPTConfig, available: int, device: torch.device
) -> PeerConfig:
    """--num-layers N|auto sets --num-stages (equal split with at most N blocks per stage)."""
    if config.num_layers is None:
        return config
    if config.num_layers == "auto":
        num_stages = memory_budget.fewest_stages_that_fit(
            model_config,
            0 if config.stage == AUTO_STAGE else config.stage,
            available,
            optimizer=config.optim.optimizer,
            precision=config.compute.precision,
            batch_size=config.compute.max_batch_size,
            device_type=device.type,
        )
    else:
        num_stages = memory_budget.blocks_per_stage_to_num_stages(model_config.n_layers, int(config.num_layers))
    print(
        f"--num-layers {config.num_layers}: {config.model} split into {num_stages} stage(s) of at most "
        f"{-(-model_config.n_layers // num_stages)} block(s)",
        flush=True,
    )
    return dataclasses.replace(config, num_stages=num_stages)
