"""`swarm profile`: measure a model layer by layer on this device, write the profile as JSON, and
(with --num-stages) suggest the balanced split to start peers with.

    swarm profile --model small --out profile.json --num-stages 2 --stage-speeds 1 0.5
    swarm profile --from-profile profile.json --out split.json --num-stages 3   # split again, no measuring
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.balanced_split import BalancedSplit, balanced_split, stage_times
from models.layer_costs import ModelProfile, split_costs
from models.model_source import resolve_model
from process.config import ConfigError, option

BITS_PER_BYTE = 8


@dataclasses.dataclass(kw_only=True)
class ProfileConfig:
    model: str = option("small", help="model to measure")
    model_dir: str | None = option(None, help="measure the model of this Hugging Face folder (its config.json) instead")
    out: str | None = option(
        None, help="write the profile (and the suggested split) to this JSON file (optional with --from-profile)"
    )
    device: str = option("cpu", help="device to measure on: cpu, cuda or cuda:N")
    batch_size: int = option(4, help="samples per measured microbatch (the trainer's --microbatch-size)")
    repeats: int = option(5, help="timed rounds over every layer; the median is kept")
    warmup: int = option(2, help="untimed rounds first")
    num_threads: int = option(1, help="torch threads while measuring (as the peers' --num-threads)")
    optimizer: str = option("adamw", help="optimizer whose state is counted", choices=["adamw", "sgd"])
    seed: int = option(0, help="seed of the weights and inputs measured")
    from_profile: str | None = option(None, help="split this profile file instead of measuring")
    num_stages: int | None = option(None, help="suggest a balanced split into this many stages")
    stage_speeds: list[float] | None = option(
        None,
        help="each stage's expected aggregate throughput relative to the "
        "measuring device (e.g. 1 0.5: the second stage is half as fast)",
    )
    link_mbit_s: float | None = option(
        None, help="also count each cut's activation and gradient transfer over links of this speed (Mbit/s)"
    )

    def __post_init__(self) -> None:
        if self.out is None and self.from_profile is None:  # a measurement is worth keeping; a re-split is printed
            raise ConfigError("--out is required (the JSON file to write the measured profile to)")
        if self.from_profile is None:
            self.model = resolve_model(self.model, self.model_dir).name
        for name in ("batch_size", "repeats", "num_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.warmup < 0:
            raise ConfigError("warmup must be at least 0")
        if self.num_stages is not None and self.num_stages < 1:
            raise ConfigError("num_stages must be at least 1")
        if self.stage_speeds and self.num_stages is None:
            raise ConfigError("--stage-speeds needs --num-stages")
        if self.stage_speeds and len(self.stage_speeds) != self.num_stages:
            raise ConfigError(
                f"--stage-speeds needs one value per stage ({self.num_stages}), got {len(self.stage_speeds)}"
            )
        if self.link_mbit_s is not None and not self.link_mbit_s > 0:
            raise ConfigError("link_mbit_s must be positive")


def measure(config: ProfileConfig) -> ModelProfile:
    import torch

    from models.profile import profile_model

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {config.device}: this machine has no CUDA device (use --device cpu)")
    torch.set_num_threads(config.num_threads)
    return profile_model(
        resolve_model(config.model, config.model_dir),
        batch_size=config.batch_size,
        device=config.device,
        repeats=config.repeats,
        warmup=config.warmup,
        optimizer=config.optimizer,
        seed=config.seed,
    )


def suggest_split(profile: ModelProfile, config: ProfileConfig) -> tuple[BalancedSplit, BalancedSplit]:
    """(balanced split, equal split) of the profile, both judged on the same costs."""
    from models.stages import equal_boundaries  # torch; only needed once a split is asked for

    link = config.link_mbit_s * 1e6 / BITS_PER_BYTE if config.link_mbit_s else None
    costs = split_costs(profile, link_bytes_per_s=link)
    balanced = balanced_split(costs, config.num_stages, config.stage_speeds)
    equal = equal_boundaries(profile.n_layers, config.num_stages)
    return balanced, BalancedSplit(equal, stage_times(costs, equal, config.stage_speeds))


def split_record(
    profile: ModelProfile, config: ProfileConfig, balanced: BalancedSplit, equal: BalancedSplit
) -> dict[str, Any]:
    return {
        "num_stages": config.num_stages,
        "boundaries": list(balanced.boundaries),
        "stage_times_s": list(balanced.stage_times_s),
        "bottleneck_s": balanced.bottleneck_s,
        "equal_boundaries": list(equal.boundaries),
        "equal_stage_times_s": list(equal.stage_times_s),
        "equal_bottleneck_s": equal.bottleneck_s,
        "stage_speeds": config.stage_speeds,
        "link_mbit_s": config.link_mbit_s,
        "stage_memory_bytes": list(profile.stage_memory_bytes(balanced.boundaries)),
    }


def print_profile(profile: ModelProfile) -> None:
    print(
        f"{profile.model} on {profile.device} ({profile.device_name}, {profile.num_threads} thread(s)), "
        f"microbatch {profile.batch_size} x {profile.seq_len} tokens, median of {profile.repeats}:"
    )
    print(
        f"  {'layer':<12} {'forward ms':>10} {'backward ms':>11} {'parameters':>11} {'memory MB':>9} {'hands on KB':>11}"
    )
    for layer in profile.layers:
        print(
            f"  {layer.name:<12} {layer.forward_s * 1e3:>10.2f} {layer.backward_s * 1e3:>11.2f} "
            f"{layer.parameters:>11,} {layer.memory_bytes / 1e6:>9.2f} {layer.output_bytes / 1e3:>11.1f}"
        )


def run_profile(config: ProfileConfig) -> int:
    profile = ModelProfile.read(config.from_profile) if config.from_profile else measure(config)
    print_profile(profile)
    extra = {}
    if config.num_stages is not None:
        balanced, equal = suggest_split(profile, config)
        extra["suggested_split"] = split_record(profile, config, balanced, equal)
        times = lambda split: ", ".join(f"{t * 1e3:.1f}" for t in split.stage_times_s)  # noqa: E731
        print(
            f"equal split    {','.join(map(str, equal.boundaries)):<16} stage ms [{times(equal)}]  "
            f"slowest {equal.bottleneck_s * 1e3:.1f} ms"
        )
        print(
            f"balanced split {','.join(map(str, balanced.boundaries)):<16} stage ms [{times(balanced)}]  "
            f"slowest {balanced.bottleneck_s * 1e3:.1f} ms"
        )
        print(
            f"start every peer with: --num-stages {config.num_stages} "
            f"--split-boundaries {','.join(map(str, balanced.boundaries))}"
        )
    if config.out is not None:
        profile.write(config.out, extra=extra)
        print(f"wrote {config.out}")
    return 0
