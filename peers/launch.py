"""Starting a peer: from a `PeerConfig` to a serving `PeerServer`.

The order matters: the metrics endpoint first (a taken port fails fast), then the DHT, the split
agreement, the stage (restored from a checkpoint if there is one), its throughput measurement, the
averager, and finally the server, which runs until SIGINT/SIGTERM and then announces offline.
"""

from __future__ import annotations

import asyncio
import os
import signal

import torch

from dht.node import start_dht
from models.config import get_model_config
from peers.averaging import GradientSync, ParameterAveraging
from peers.checkpoint import checkpoint_path
from peers.config import PeerConfig
from peers.faults import FaultSettings, FaultyStageRuntime
from peers.metrics import PeerMetrics, advertised_metrics_addr, serve_metrics
from peers.server import PeerServer
from peers.outer_step import OuterSettings
from peers.split_claim import claim_split, split_tag
from peers.stage_runtime import OptimizerSettings, StageRuntime
from swarm import compression


def run_peer(config: PeerConfig) -> None:
    """Start the DHT node, measure the stage, serve until SIGINT/SIGTERM, then announce offline."""
    torch.set_num_threads(config.num_threads)
    model_config = get_model_config(config.model)
    settings = OptimizerSettings(lr=config.lr, weight_decay=config.weight_decay,
                                 target_batch_size=config.target_batch_size, kind=config.optimizer)
    metrics = PeerMetrics()
    endpoint = serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)  # before the DHT: fails fast
    metrics_addr = endpoint and advertised_metrics_addr(endpoint.host, endpoint.port, host_maddrs=config.host_maddrs,
                                                        announce_maddrs=config.announce_maddrs)
    if endpoint:
        print(f"metrics on {endpoint.url} (announced as {metrics_addr or 'nothing: no reachable address known'})",
              flush=True)
    dht = start_dht(config)
    try:
        # The split is agreed on the DHT before the stage is built: a peer whose split disagrees
        # with the swarm's stops here with a SplitConflictError.
        split = claim_split(dht, model=config.model, peer_id=dht.peer_id.to_base58(),
                            requested=config.requested_boundaries, num_stages=config.num_stages,
                            n_layers=model_config.n_layers, ttl_s=config.record_ttl_s)
        runtime = StageRuntime(model_config, config.stage, config.num_stages, seed=config.seed, optimizer=settings,
                               max_batch_size=config.max_batch_size, activation_cache_size=config.activation_cache_size,
                               boundaries=split.boundaries)
        if config.checkpoint_dir:
            path = checkpoint_path(config.checkpoint_dir, config.model, config.stage, config.num_stages,
                                   split_tag(split, model_config.n_layers))
            if os.path.exists(path):
                runtime.restore(path, config.model)
                print(f"restored stage {config.stage} from {path} ({runtime.steps_done} steps done)", flush=True)
        runtime.measure_throughput()
        stage_runtime = runtime
        faults = FaultSettings(slowdown=config.fault_slowdown, fail_rate=config.fault_fail_rate,
                               garbage=config.fault_garbage, garbage_rate=config.fault_garbage_rate, seed=config.seed)
        if faults.enabled:
            print(f"fault injection on: {faults}", flush=True)
            runtime = FaultyStageRuntime(runtime, faults)
        compression.BlockwiseInt8Codec.warm_up()  # bitsandbytes loads its kernels on first use (~1-2 s)
        averaging = None
        metrics.set_averaging_mode(config.averaging)
        if config.averaging == "sync":
            averaging = GradientSync(stage_runtime, dht, config.model, timeout_s=config.averaging_timeout_s,
                                     compression=config.averaging_compression or "none",
                                     on_round=metrics.observe_averaging_round)
        elif config.averaging == "periodic":
            averaging = ParameterAveraging(stage_runtime, dht, config.model, period_s=config.averaging_period_s,
                                           timeout_s=config.averaging_timeout_s,
                                           compression=config.averaging_compression or "none",
                                           outer=OuterSettings(config.outer_lr, config.outer_momentum)
                                           if config.outer_lr > 0 else None,
                                           on_round=metrics.observe_averaging_round)
        asyncio.run(_serve_until_signalled(PeerServer(config, runtime, dht, averaging, metrics=metrics,
                                                      metrics_addr=metrics_addr, split=split)))
    finally:
        dht.shutdown()
        if endpoint:
            endpoint.close()


async def _serve_until_signalled(server: PeerServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.serve(stop)
