"""`swarm export`'s configuration."""

from __future__ import annotations

import dataclasses

from dht.authority import RunAccessConfig
from dht.node import NetworkConfig
from models.subspace_options import SubspaceSettings
from process.config import ConfigError, option, section


@dataclasses.dataclass(kw_only=True)
class ExportConfig(NetworkConfig):
    model: str = option("small", help="model name; must match the peers'")
    model_dir: str | None = option(
        None,
        help="the Hugging Face model folder the peers serve (--model-dir of `swarm peer`): its config gives the model",
    )
    out: str | None = option(None, help="folder to write (model.safetensors, config.json, tokenizer.json with --data)")
    checkpoint_dir: list[str] = option(
        default_factory=list,
        help="offline: read the stages from these peers' checkpoint folders (--checkpoint-dir D1 D2 ...) "
        "instead of the live swarm",
    )
    data: str | None = option(
        None, help="the run's prepared data folder (`swarm data prepare`): its tokenizer.json is copied"
    )
    overwrite: bool = option(False, help="replace --out if it exists")
    adapters_only: bool = option(
        False,
        help="a run trained with --trainable lora:R: write its adapters apart (adapters.safetensors, "
        "adapter_config.json) instead of merging them into the weights",
    )
    seed: int = option(
        0,
        help="the peers' --seed: with adapters, their base weights (without --init-weights); with a fixed "
        "subspace, its basis",
    )
    init_weights: str | None = option(None, help="a run with adapters: the peers' --init-weights (their base weights)")
    vocab_size: int | None = option(
        None, help="a run with adapters: the peers' --vocab-size (default: the live peers' records, else the model's)"
    )
    num_stages: int | None = option(None, help="number of stages (default: the swarm's split)")
    wait_s: float = option(60.0, help="live: wait this long for every stage to have an online replica")
    download_timeout_s: float = option(300.0, help="live: give up one replica's download after this many seconds")
    authority: RunAccessConfig = section(
        RunAccessConfig, help="live, a run with an authority: its run file and a credential to download state"
    )
    subspace: SubspaceSettings = section(
        SubspaceSettings, help="the peers' subspace options (a fixed subspace is folded into plain weights)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.out:
            raise ConfigError("--out is required: the folder to write the model to")
        if not self.checkpoint_dir and not self.initial_peers:
            raise ConfigError(
                "give --initial-peers (export from the live swarm) or --checkpoint-dir (from checkpoints)"
            )
        if self.wait_s < 0 or self.download_timeout_s <= 0:
            raise ConfigError("--wait-s must be >= 0 and --download-timeout-s positive")
