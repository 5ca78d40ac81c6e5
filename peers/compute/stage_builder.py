"""Building what a peer needs to serve one stage: the runtime (restored from a checkpoint if there
is one, its throughput measured, fault injection wrapped around it) and the replica averager.

The launcher builds the first stage with it; a peer that moves (peers/placement/stage_moves.py) builds the
next one with the same settings, so a moved peer serves exactly as if it had started there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import hivemind
import torch

from dht.records import SplitRecord
from models.config import GPTConfig
from models.hf_format import load_stage_from_folder
from models.init_weights import InitWeightsError, load_stage_weights
from models.stages import stage_spec
from peers.compute import memory_budget
from peers.compute.checkpoint import checkpoint_path
from peers.compute.faults import (
    FaultyStageRuntime,
    HeldRoundSync,
    LyingContribution,
    LyingParameterAveraging,
    RoundMissingSync,
)
from peers.compute.stage_runtime import StageRuntime
from peers.config import PeerConfig
from peers.placement.split_claim import split_tag
from peers.replicas.averaging import GradientSync, ParameterAveraging
from peers.replicas.averaging_auto import resolve_auto
from peers.replicas.delayed_sync import DelayedGradientSync
from peers.replicas.gloo_allreduce import GlooRounds, announced_host
from peers.replicas.outer_averaging import OuterAveraging
from peers.replicas.sync_exchange import SyncExchange
from process.config import ConfigError

AUTO_STEP_SAMPLES = 16  # --averaging auto: the samples a replica computes in a step, to weigh a round against


@dataclass
class BuiltStage:
    runtime: StageRuntime | FaultyStageRuntime
    averaging: GradientSync | ParameterAveraging | OuterAveraging | None


@dataclass
class StageBuilder:
    config: PeerConfig
    model_config: GPTConfig
    dht: hivemind.DHT
    split: SplitRecord
    on_averaging_round: Callable[..., None] | None = None
    device: torch.device = torch.device("cpu")
    available_bytes: int | None = None  # memory this peer may use; None: no check
    memory_source: str = "--memory-limit-gb"
    schedule: Callable[[], object] | None = None  # the run's learning rates (its spec's versions), for new runtimes
    members_only: bool = False  # a run with an authority: only credentialed replicas average (filled in by the host)
    gloo: GlooRounds | None = None  # exact sync over gloo: this peer's rendezvous, made on first use
    exchange: SyncExchange | None = None  # exact sync by exchange: made on first use, bound by the host

    def named_round_transport(self, replicas) -> str:
        """How exact sync's rounds of named groups travel (`--averaging-transport`): "gloo" (auto: in
        a run without an authority, on an address the peer announces), "exchange" (auto: otherwise)
        or "hivemind" (asked for, or what the others cannot do: a codec, the one-step delay,
        matchmaking; gloo asked for where no address is announced)."""
        transport = replicas.averaging_transport
        if transport == "hivemind" or replicas.sync_delay or replicas.averaging_groups != "trainer":
            return "hivemind"
        if replicas.averaging_compression not in (None, "none"):  # they send float32: a codec stays on hivemind
            return "hivemind"
        if transport == "exchange" or (transport == "auto" and self.members_only):
            return "exchange"
        network = self.config.network
        if announced_host(network.announce_maddrs, network.host_maddrs) is not None:
            return "gloo"
        return "exchange" if transport == "auto" else "hivemind"

    def gloo_rounds(self) -> GlooRounds:
        """This peer's gloo rendezvous (one, whatever stage it serves), started on first use."""
        if self.gloo is None:
            network = self.config.network
            host = announced_host(network.announce_maddrs, network.host_maddrs)
            self.gloo = GlooRounds(host, timeout_s=self.config.replicas.averaging_timeout_s)
            print(f"exact sync all-reduces over gloo; rendezvous at {self.gloo.address}", flush=True)
        return self.gloo

    def sync_exchange(self) -> SyncExchange:
        """This peer's exchange (one, whatever stage it serves), made on first use."""
        if self.exchange is None:
            self.exchange = SyncExchange(model=self.config.model, timeout_s=self.config.replicas.averaging_timeout_s)
        return self.exchange

    def build(self, stage: int) -> BuiltStage:
        """Blocking (builds modules, may read a checkpoint, runs a short benchmark)."""
        config = self.config
        cache_budget = None
        if self.available_bytes is not None:
            spec = stage_spec(self.model_config, stage, config.num_stages, self.split.boundaries)
            estimate = check_stage_memory(
                config, self.model_config, spec, self.available_bytes, self.memory_source, self.device
            )
            print(
                f"memory: stage {stage} needs about {estimate.describe()}; {self.memory_source}: "
                f"{self.available_bytes / memory_budget.GiB:.2f} GiB",
                flush=True,
            )
            cache_budget = memory_budget.cache_budget_bytes(estimate, self.available_bytes)
        runtime = StageRuntime(
            self.model_config,
            stage,
            config.num_stages,
            seed=config.seed,
            optimizer=config.optim,
            max_batch_size=config.compute.max_batch_size,
            activation_cache_size=config.compute.activation_cache_size,
            boundaries=self.split.boundaries,
            device=self.device,
            precision=config.compute.precision,
            cache_budget_bytes=cache_budget,
        )
        if config.init_weights:
            try:
                count = load_stage_weights(runtime.module, config.init_weights)
            except InitWeightsError as e:
                raise ConfigError(str(e)) from None
            print(f"loaded {count} initial tensors of stage {stage} from {config.init_weights}", flush=True)
        if config.model_dir:  # ModelFolderError (one line) for a missing, truncated or mis-shaped tensor
            count = load_stage_from_folder(runtime.module, config.model_dir)
            print(f"loaded {count} tensors of stage {stage} from {config.model_dir}", flush=True)
        adapters = runtime.use_adapters()  # after the base weights, before a checkpoint of adapters
        if adapters:
            print(f"stage {stage}: {adapters} adapter parameters trainable ({self.model_config.trainable})", flush=True)
        if config.checkpointing.checkpoint_dir:
            path = checkpoint_path(
                config.checkpointing.checkpoint_dir,
                config.model,
                stage,
                config.num_stages,
                split_tag(self.split, self.model_config.n_layers),
            )
            if os.path.exists(path):
                runtime.restore(path, config.model)
                print(f"restored stage {stage} from {path} ({runtime.steps_done} steps done)", flush=True)
        if self.schedule is not None:
            runtime.follow_schedule(self.schedule())
        runtime.measure_throughput()
        replicas, reason = config.replicas, ""
        if replicas.averaging == "auto":  # settled now, from the stage's replicas or the measured links
            replicas, reason = resolve_auto(
                replicas,
                dht=self.dht,
                model=config.model,
                stage=stage,
                num_stages=config.num_stages,
                peer_id=self.dht.peer_id.to_base58(),
                num_values=sum(p.numel() for p in runtime.params),
                # a replica's share of a trainer's default batch (32 samples, two replicas)
                step_s=AUTO_STEP_SAMPLES / max(float(runtime.throughput.value), 1e-9),
            )
            print(f"stage {stage}: --averaging auto: {replicas.averaging} ({reason})", flush=True)
        averaging = None
        members = () if self.members_only else None
        matchmaking = (
            {} if replicas.averaging_matchmaking_s is None else {"matchmaking_s": replicas.averaging_matchmaking_s}
        )
        if replicas.averaging == "sync":
            transport = self.named_round_transport(replicas)
            named_rounds = (
                {"gloo": self.gloo_rounds()}
                if transport == "gloo"
                else {"exchange": self.sync_exchange()}
                if transport == "exchange"
                else {}
            )
            miss_round, lie = config.faults.fault_miss_sync_round, config.faults.fault_averaging
            sync_class = DelayedGradientSync if replicas.sync_delay else GradientSync
            # with the delay: exact until it begins (by default, once the warmup is over)
            delay = {"exact_steps": config.exact_steps_before_delay} if replicas.sync_delay else {}
            runtime.weight_prediction = replicas.weight_prediction if replicas.sync_delay else "none"
            if miss_round:  # the fault's round taken as failed, in either mode
                faulty = type(f"RoundMissing{sync_class.__name__}", (RoundMissingSync, sync_class), {})
                sync_class = partial(faulty, miss_round=miss_round)
            elif config.faults.fault_hold == "round":  # one named round held before it begins
                held = type(f"Held{sync_class.__name__}", (HeldRoundSync, sync_class), {})
                sync_class = partial(held, hold_after=config.faults.fault_hold_after, hold_s=config.faults.fault_hold_s)
            elif lie != "none":  # the replica's contribution to the all-reduce multiplied, in either mode
                lying = type(f"Lying{sync_class.__name__}", (LyingContribution, sync_class), {})
                sync_class = partial(lying, lie=lie)
            averaging = sync_class(
                runtime,
                self.dht,
                config.model,
                timeout_s=replicas.averaging_timeout_s,
                compression=replicas.averaging_compression or "none",
                on_round=self.on_averaging_round,
                members=members,
                **matchmaking,
                robust=replicas.robust_averaging,
                named_groups=replicas.averaging_groups == "trainer",
                **delay,
                **named_rounds,
            )
        elif replicas.averaging == "periodic":
            lie = config.faults.fault_averaging
            averaging = (ParameterAveraging if lie == "none" else partial(LyingParameterAveraging, lie=lie))(
                runtime,
                self.dht,
                config.model,
                schedule=replicas.schedule,
                timeout_s=replicas.averaging_timeout_s,
                compression=replicas.averaging_compression or "none",
                outer=replicas.outer,
                on_round=self.on_averaging_round,
                members=members,
                **matchmaking,
                robust=replicas.robust_averaging,
                named_groups=replicas.averaging_groups == "trainer",
            )
        elif replicas.averaging == "outer":
            averaging = OuterAveraging(
                runtime,
                schedule=replicas.outer_schedule,
                settings=replicas.outer_step_settings,
                codec=replicas.outer_codec_settings,
                robust=replicas.robust_averaging,
                timeout_s=replicas.averaging_timeout_s,
                on_round=self.on_averaging_round,
            )
            if members is not None:
                averaging.set_members(members)
        if averaging is not None:
            averaging.reason = reason
        served = FaultyStageRuntime(runtime, config.faults, seed=config.seed) if config.faults.enabled else runtime
        return BuiltStage(served, averaging)


def check_stage_memory(
    config: PeerConfig, model_config: GPTConfig, spec, available: int, source: str, device: torch.device
) -> memory_budget.MemoryEstimate:
    """Refuse (MemoryBudgetError, one line) when the stage, its optimizer and one microbatch do not fit."""
    estimate = memory_budget.estimate_stage_memory(
        model_config,
        spec,
        optimizer=config.optim.optimizer,
        precision=config.compute.precision,
        batch_size=config.compute.max_batch_size,
        device_type=device.type,
    )
    memory_budget.check_fits(
        estimate,
        available,
        source=source,
        what=f"{config.model} stage {spec.index}/{spec.num_stages} (blocks {spec.first_layer}.."
        f"{spec.last_layer - 1}, {estimate.parameters / 1e6:.1f}M parameters)",
    )
    return estimate
