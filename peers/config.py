"""The peer's configuration: one dataclass, filled from CLI flags and SWARM_* environment variables."""

from __future__ import annotations

import dataclasses

from dht.configuration import ConfigError, option
from dht.node import NetworkConfig
from models.config import get_model_config
from models.stages import stage_spec
from peers.devices import DEVICE_CHOICES_HELP, OPTIMIZERS, PRECISIONS
from peers.metrics import validate_metrics_options


@dataclasses.dataclass(kw_only=True)
class PeerConfig(NetworkConfig):
    model: str = option("small", help="model name (see `swarm train --help` for the list)")
    stage: int | None = option(None, help="pipeline stage this peer serves, 0-based")
    num_stages: int = option(2, help="number of pipeline stages the model is split into")
    seed: int = option(0, help="seed of the initial weights; every peer of a swarm must use the same")
    optimizer: str = option("adamw", help="local optimizer (adamw8bit: bitsandbytes' 8-bit AdamW, ~2 instead of 8 "
                            "bytes of state per parameter)", choices=list(OPTIMIZERS))
    lr: float = option(1e-3, help="learning rate of the local optimizer")
    weight_decay: float = option(0.01, help="AdamW weight decay")
    target_batch_size: int = option(32, help="samples accumulated before each optimizer step")
    num_threads: int = option(1, help="torch compute threads")
    max_batch_size: int = option(256, help="largest microbatch (samples) this peer accepts")
    activation_cache_size: int = option(64, help="forward activations kept for backwards that come back here")
    announce_period_s: float = option(5.0, help="re-announce this peer on the DHT this often")
    status_file: str | None = option(None, help="write this peer's state here as JSON at every announcement "
                                     "(read by `python -m peers.health`, the container's health check)")
    max_concurrent_requests: int = option(64, help="requests served at once; more wait")
    checkpoint_dir: str | None = option(None, help="save the stage here (atomically) periodically and on exit; "
                                        "restore from it at start")
    averaging: str = option("none", help="how replicas of a stage agree: none (independent), sync (average "
                            "gradients on each trainer step, identical parameters), periodic (average parameters "
                            "every --averaging-period-s)", choices=["none", "sync", "periodic"])
    averaging_period_s: float = option(30.0, help="seconds between parameter averaging rounds (periodic mode)")
    averaging_compression: str | None = option(None, help="averaging traffic: none or fp16 (halves the bytes; replicas then agree only to fp16 "
                                                 "precision of their differences)", choices=["none", "fp16"])
    averaging_timeout_s: float = option(30.0, help="give up an averaging round after this many seconds")
    load_state: bool = option(True, help="on start, download the stage's current state from a live replica")
    fault_slowdown: float = option(1.0, help="testing only: make every compute this many times slower")
    fault_fail_rate: float = option(0.0, help="testing only: fail this fraction of calls")
    checkpoint_period_s: float = option(300.0, help="seconds between periodic checkpoints (with --checkpoint-dir)")
    metrics_port: int = option(0, help="serve Prometheus metrics on this port (0 = any free port, announced in the "
                               "peer's DHT record for `swarm monitor targets`; -1 = off)")
    metrics_host: str = option("127.0.0.1", help="interface the metrics endpoint listens on (0.0.0.0 = all)")
    device: str = option("auto", help=f"where the stage computes: {DEVICE_CHOICES_HELP}")
    precision: str = option("fp32", help="compute precision (bf16/fp16: autocast; weights and optimizer stay fp32; "
                            "the wire format is the codec's either way)", choices=list(PRECISIONS))
    memory_limit_gb: float | None = option(None, help="memory this peer may use (default: what the device has free); "
                                           "the peer refuses to start when its stage does not fit")
    num_layers: str | None = option(None, help="blocks per stage: N, or auto (the most that fit in memory); "
                                    "sets --num-stages to the equal split with stages of at most that many blocks")
    init_weights: str | None = option(None, help="a local .safetensors file with the whole model's initial weights "
                                      "(names as in models.stages.build_full_model); this stage loads its part")
    reachability_check: str = option("auto", help="at start, ask up to 3 online peers to dial this one back and say "
                                     "whether others can reach it: auto (skipped when every address is loopback, "
                                     "where it proves nothing), always, off", choices=["auto", "always", "off"])
    split_boundaries: str | None = option(None, help="block boundaries of the stage split, e.g. 0,4,6 (from `swarm "
                                          "profile`); default: the swarm's split, or the equal split")

    def __post_init__(self) -> None:
        super().__post_init__()
        config = get_model_config(self.model)
        if self.stage is None:
            raise ConfigError("--stage is required (the pipeline stage to serve, 0-based)")
        stage_spec(config, self.stage, self.num_stages, self.requested_boundaries)  # StageSplitError for a bad stage
        for name in ("lr", "announce_period_s", "averaging_period_s", "averaging_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        validate_metrics_options(self.metrics_host, self.metrics_port)
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ConfigError("--memory-limit-gb must be positive")
        if self.num_layers is not None:
            if self.split_boundaries is not None:
                raise ConfigError("--num-layers and --split-boundaries both choose the split; give one")
            if self.num_layers != "auto" and not (self.num_layers.isdigit() and int(self.num_layers) >= 1):
                raise ConfigError(f"--num-layers {self.num_layers!r}: expected a positive number of blocks or auto")
        if self.fault_slowdown < 1.0 or not 0.0 <= self.fault_fail_rate <= 1.0:
            raise ConfigError("--fault-slowdown must be >= 1 and --fault-fail-rate within [0, 1]")
        for name in ("target_batch_size", "num_threads", "max_batch_size", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")

    @property
    def requested_boundaries(self) -> tuple[int, ...] | None:
        if self.split_boundaries is None:
            return None
        try:
            return tuple(int(part) for part in self.split_boundaries.replace(" ", "").split(","))
        except ValueError:
            raise ConfigError(f"--split-boundaries {self.split_boundaries!r}: expected comma-separated block "
                              f"indices such as 0,4,6") from None

    @property
    def record_ttl_s(self) -> float:
        """A record outlives a few missed announcements, no more."""
        return max(3 * self.announce_period_s, 3.0)
