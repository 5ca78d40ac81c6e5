"""Starting a peer: from a `PeerConfig` to a serving `PeerServer`.

The order matters: the device and the memory check first (a stage that cannot fit is refused
before anything starts), then the metrics endpoint (a taken port fails fast), the DHT, the split
agreement, the stage (initial weights from --init-weights, then restored from a checkpoint if there
is one), its throughput measurement, the averager, and finally the server, which runs until
SIGINT/SIGTERM and then announces offline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import torch

from dht.configuration import ConfigError
from dht.node import start_dht
from models.config import GPTConfig, get_model_config
from models.init_weights import InitWeightsError, load_stage_weights
from models.stages import stage_spec
from peers import memory_budget
from peers.averaging import GradientSync, ParameterAveraging
from peers.checkpoint import checkpoint_path
from peers.config import PeerConfig
from peers.devices import DeviceError, check_optimizer, describe_device, resolve_device
from peers.faults import FaultSettings, FaultyStageRuntime
from peers.metrics import PeerMetrics, advertised_metrics_addr, serve_metrics
from peers.server import PeerServer
from peers.split_claim import claim_split, split_tag
from peers.stage_runtime import OptimizerSettings, StageRuntime
from swarm import compression


def run_peer(config: PeerConfig) -> None:
    """Start the DHT node, measure the stage, serve until SIGINT/SIGTERM, then announce offline."""
    torch.set_num_threads(config.num_threads)
    model_config = get_model_config(config.model)
    device = resolve_device(config.device)
    print(f"device: {describe_device(device)} (--device {config.device}); precision {config.precision}; "
          f"optimizer {config.optimizer}", flush=True)
    check_optimizer(config.optimizer, device)
    if config.init_weights and not os.path.isfile(config.init_weights):
        raise ConfigError(f"--init-weights {config.init_weights!r}: no such file")
    if device.type != "cpu" and config.averaging != "none":
        raise DeviceError(f"--averaging {config.averaging} is only supported with --device cpu so far (hivemind's "
                          f"averager works on CPU tensors); use --averaging none on a GPU")
    available, source = _memory_available(config, device)
    config = _resolve_num_layers(config, model_config, available, device)
    requested_spec = stage_spec(model_config, config.stage, config.num_stages, config.requested_boundaries)
    estimate = _check_memory(config, model_config, requested_spec, available, source, device)
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
        spec = stage_spec(model_config, config.stage, config.num_stages, split.boundaries)
        if spec.layers != requested_spec.layers:  # the swarm's split gives this stage other blocks: check again
            estimate = _check_memory(config, model_config, spec, available, source, device)
        runtime = StageRuntime(model_config, config.stage, config.num_stages, seed=config.seed, optimizer=settings,
                               max_batch_size=config.max_batch_size, activation_cache_size=config.activation_cache_size,
                               boundaries=split.boundaries, device=device, precision=config.precision,
                               cache_budget_bytes=memory_budget.cache_budget_bytes(estimate, available))
        if config.init_weights:
            try:
                count = load_stage_weights(runtime.module, config.init_weights)
            except InitWeightsError as e:
                raise ConfigError(str(e)) from None
            print(f"loaded {count} initial tensors of stage {config.stage} from {config.init_weights}", flush=True)
        if config.checkpoint_dir:
            path = checkpoint_path(config.checkpoint_dir, config.model, config.stage, config.num_stages,
                                   split_tag(split, model_config.n_layers))
            if os.path.exists(path):
                runtime.restore(path, config.model)
                print(f"restored stage {config.stage} from {path} ({runtime.steps_done} steps done)", flush=True)
        runtime.measure_throughput()
        stage_runtime = runtime
        faults = FaultSettings(slowdown=config.fault_slowdown, fail_rate=config.fault_fail_rate, seed=config.seed)
        if faults.enabled:
            print(f"fault injection on: {faults}", flush=True)
            runtime = FaultyStageRuntime(runtime, faults)
        compression.BlockwiseInt8Codec.warm_up()  # bitsandbytes loads its kernels on first use (~1-2 s)
        averaging = None
        if config.averaging == "sync":
            averaging = GradientSync(stage_runtime, dht, config.model, timeout_s=config.averaging_timeout_s,
                                     compression=config.averaging_compression or "none")
        elif config.averaging == "periodic":
            averaging = ParameterAveraging(stage_runtime, dht, config.model, period_s=config.averaging_period_s,
                                           timeout_s=config.averaging_timeout_s,
                                           compression=config.averaging_compression or "none")
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


def _memory_available(config: PeerConfig, device: torch.device) -> tuple[int, str]:
    if config.memory_limit_gb is not None:
        return int(config.memory_limit_gb * memory_budget.GiB), "--memory-limit-gb"
    return memory_budget.available_memory_bytes(device), f"the memory free on {device}"


def _resolve_num_layers(config: PeerConfig, model_config: GPTConfig, available: int, device: torch.device) -> PeerConfig:
    """--num-layers N|auto sets --num-stages (equal split with at most N blocks per stage)."""
    if config.num_layers is None:
        return config
    if config.num_layers == "auto":
        num_stages = memory_budget.fewest_stages_that_fit(
            model_config, config.stage, available, optimizer=config.optimizer, precision=config.precision,
            batch_size=config.max_batch_size, device_type=device.type)
    else:
        num_stages = memory_budget.blocks_per_stage_to_num_stages(model_config.n_layers, int(config.num_layers))
    print(f"--num-layers {config.num_layers}: {config.model} split into {num_stages} stage(s) of at most "
          f"{-(-model_config.n_layers // num_stages)} block(s)", flush=True)
    return dataclasses.replace(config, num_stages=num_stages)


def _check_memory(config: PeerConfig, model_config: GPTConfig, spec, available: int, source: str,
                  device: torch.device) -> memory_budget.MemoryEstimate:
    estimate = memory_budget.estimate_stage_memory(model_config, spec, optimizer=config.optimizer,
                                                   precision=config.precision, batch_size=config.max_batch_size,
                                                   device_type=device.type)
    memory_budget.check_fits(estimate, available, source=source,
                             what=f"{config.model} stage {spec.index}/{spec.num_stages} (blocks {spec.first_layer}.."
                                  f"{spec.last_layer - 1}, {estimate.parameters / 1e6:.1f}M parameters)")
    print(f"memory: stage needs about {estimate.describe()}; {source}: {available / memory_budget.GiB:.2f} GiB",
          flush=True)
    return estimate
