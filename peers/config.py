"""The peer's configuration: one dataclass, filled from CLI flags and SWARM_* environment variables."""

from __future__ import annotations

import dataclasses

from dht.node import NetworkConfig
from models.config import get_model_config
from models.stages import stage_spec
from peers.compute.devices import DEVICE_CHOICES_HELP, OPTIMIZERS, PRECISIONS
from peers.replicas.averaging_schedule import AveragingSchedule
from process.config import ConfigError, option
from process.metrics_http import validate_metrics_options

AUTO_STAGE = "auto"
DEFAULT_AVERAGING_PERIOD_S = 30.0


@dataclasses.dataclass(kw_only=True)
class PeerConfig(NetworkConfig):
    model: str = option("small", help="model name (see `swarm train --help` for the list)")
    stage: str | int | None = option(
        None,
        help="pipeline stage this peer serves, 0-based, or `auto`: the stage that "
        "needs a peer most (see peers/placement/stage_choice.py)",
    )
    num_stages: int = option(2, help="number of pipeline stages the model is split into")
    seed: int = option(0, help="seed of the initial weights; every peer of a swarm must use the same")
    optimizer: str = option(
        "adamw",
        help="local optimizer (adamw8bit: bitsandbytes' 8-bit AdamW, ~2 instead of 8 bytes of state per parameter)",
        choices=list(OPTIMIZERS),
    )
    lr: float = option(1e-3, help="learning rate of the local optimizer")
    weight_decay: float = option(0.01, help="AdamW weight decay")
    target_batch_size: int = option(32, help="samples accumulated before each optimizer step")
    num_threads: int = option(1, help="torch compute threads")
    max_batch_size: int = option(256, help="largest microbatch (samples) this peer accepts")
    activation_cache_size: int = option(64, help="forward activations kept for backwards that come back here")
    announce_period_s: float = option(5.0, help="re-announce this peer on the DHT this often")
    status_file: str | None = option(
        None,
        help="write this peer's state here as JSON at every announcement "
        "(read by `python -m peers.health`, the container's health check)",
    )
    max_concurrent_requests: int = option(64, help="requests served at once; more wait")
    max_request_mb: float = option(64.0, help="refuse a request whose tensors carry more than this many MiB")
    bad_request_burst: int = option(10, help="bad requests a caller may send in a row before it is refused for a while")
    bad_request_refill_per_s: float = option(
        0.2,
        help="bad requests per second a caller may keep sending; beyond "
        "that (after the burst) it is refused until its allowance refills",
    )
    checkpoint_dir: str | None = option(
        None, help="save the stage here (atomically) periodically and on exit; restore from it at start"
    )
    averaging: str = option(
        "none",
        help="how replicas of a stage agree: none (independent), sync (average "
        "gradients on each trainer step, identical parameters), periodic (average parameters "
        "every --averaging-period-s or --averaging-every-steps)",
        choices=["none", "sync", "periodic"],
    )
    averaging_period_s: float | None = option(
        None,
        help="periodic mode: average parameters every this many seconds "
        "of DHT time; each replica steps on its own at --target-batch-size "
        f"(default {DEFAULT_AVERAGING_PERIOD_S:g} unless "
        "--averaging-every-steps)",
    )
    averaging_every_steps: int | None = option(
        None,
        help="periodic mode: instead of a period, average parameters "
        "right after every this many local steps; each replica then steps on "
        "the trainer's commit (on its share of the trainer's batch), and the "
        "commit waits for the round (hivemind bounds its matchmaking and its "
        "all-reduce by --averaging-timeout-s each)",
    )
    averaging_compression: str | None = option(
        None,
        help="averaging traffic: none (default; replicas agree exactly), "
        "fp16 (half the bytes) or int8 (blockwise 8-bit, a quarter); compressed, "
        "replicas agree only up to the codec's rounding of their differences "
        "(measured after one step at lr 0.5: fp16 6e-5, int8 1.6e-3)",
        choices=["none", "fp16", "int8"],
    )
    outer_lr: float = option(
        0.0,
        help="periodic mode: outer learning rate of a DiLoCo-style Nesterov step on the "
        "averaged parameter delta after each round (DiLoCo: 0.7); 0 = off, plain averaging",
    )
    outer_momentum: float = option(0.9, help="periodic mode: momentum of the outer step (with --outer-lr)")
    averaging_timeout_s: float = option(30.0, help="give up an averaging round after this many seconds")
    load_state: bool = option(True, help="on start, download the stage's current state from a live replica")
    fault_slowdown: float = option(1.0, help="testing only: make every compute this many times slower")
    fault_slowdown_mode: str = option(
        "sleep",
        help="testing only: spend --fault-slowdown's extra time asleep (a "
        "separate slower device), busy computing (a slower device sharing this "
        "machine's CPU with the other peers), or as a device: each call lasts "
        "--fault-slowdown x the CPU time it used (others' load not multiplied)",
        choices=["sleep", "busy", "device"],
    )
    fault_fail_rate: float = option(0.0, help="testing only: fail this fraction of calls")
    fault_garbage: str = option(
        "none",
        help="testing only: answer with garbage (nan: NaN values; shape: one value "
        "short) while computing correctly inside",
        choices=["none", "nan", "shape"],
    )
    fault_garbage_rate: float = option(1.0, help="testing only: fraction of calls answered with --fault-garbage")
    checkpoint_period_s: float = option(300.0, help="seconds between periodic checkpoints (with --checkpoint-dir)")
    metrics_port: int = option(
        0,
        help="serve Prometheus metrics on this port (0 = any free port, announced in the "
        "peer's DHT record for `swarm monitor targets`; -1 = off)",
    )
    metrics_host: str = option("127.0.0.1", help="interface the metrics endpoint listens on (0.0.0.0 = all)")
    rebalance_period_s: float = option(
        0.0,
        help="check about this often (randomised in [0.5, 1.5] x) whether moving to "
        "another stage raises the swarm's bottleneck, and move if so (0 = never move)",
    )
    rebalance_loss_watch_s: float = option(
        5.0,
        help="with --rebalance-period-s: also re-read the swarm this often "
        "and, when a stage lost a replica since the last look, check within "
        "--rebalance-loss-delay-s instead of at the next period (0 = periodic only)",
    )
    rebalance_loss_delay_s: float = option(
        10.0,
        help="longest random delay from seeing a lost replica to the check "
        "it triggers (spreads the peers' reads of the DHT)",
    )
    rebalance_min_gain: float = option(
        0.2, help="move only if the swarm's bottleneck throughput rises by more than this fraction (hysteresis)"
    )
    standby: bool = option(
        False,
        help="join the backup pool: serve nothing, keep a recent copy of the thinnest stage's "
        "state and take over at once when a stage loses its last replica or falls far behind",
    )
    standby_refresh_s: float = option(30.0, help="standby: re-download the held stage's state this often")
    standby_check_s: float = option(2.0, help="standby: look for a stage that needs taking over this often")
    standby_take_over_fraction: float = option(
        0.5,
        help="standby: also take over a stage whose throughput fell below "
        "this fraction of the other stages' mean (0 = only a stage left "
        "without an online replica)",
    )
    device: str = option("auto", help=f"where the stage computes: {DEVICE_CHOICES_HELP}")
    precision: str = option(
        "fp32",
        help="compute precision (bf16/fp16: autocast; weights and optimizer stay fp32; "
        "the wire format is the codec's either way)",
        choices=list(PRECISIONS),
    )
    memory_limit_gb: float | None = option(
        None,
        help="memory this peer may use (default: what the device has free); "
        "the peer refuses to start when its stage does not fit",
    )
    num_layers: str | None = option(
        None,
        help="blocks per stage: N, or auto (the most that fit in memory); "
        "sets --num-stages to the equal split with stages of at most that many blocks",
    )
    init_weights: str | None = option(
        None,
        help="a local .safetensors file with the whole model's initial weights "
        "(names as in models.stages.build_full_model); this stage loads its part",
    )
    reachability_check: str = option(
        "auto",
        help="at start, ask up to 3 online peers to dial this one back and say "
        "whether others can reach it: auto (skipped when every address is loopback, "
        "where it proves nothing), always, off",
        choices=["auto", "always", "off"],
    )
    split_boundaries: str | None = option(
        None,
        help="block boundaries of the stage split, e.g. 0,4,6 (from `swarm "
        "profile`); default: the swarm's split, or the equal split",
    )
    link_probe_period_s: float = option(
        60.0,
        help="measure round-trip time and bandwidth to a few other peers about "
        "this often (randomized) and publish them for `swarm plan --from-dht`; 0 = off",
    )
    link_probe_peers: int = option(8, help="peers probed per round, at most")

    def __post_init__(self) -> None:
        super().__post_init__()
        config = get_model_config(self.model)
        if self.standby:
            if self.stage not in (None, AUTO_STAGE):
                raise ConfigError("--standby chooses its stage itself: leave out --stage (or say --stage auto)")
            self.stage = AUTO_STAGE
        if self.stage is None:
            raise ConfigError("--stage is required (the pipeline stage to serve, 0-based, or auto)")
        if self.stage != AUTO_STAGE:
            try:
                self.stage = int(self.stage)
            except ValueError:
                raise ConfigError(f"--stage {self.stage!r}: expected a stage number or auto") from None
        # StageSplitError for a bad stage or split (auto: the split is checked on stage 0)
        stage_spec(config, 0 if self.stage == AUTO_STAGE else self.stage, self.num_stages, self.requested_boundaries)
        if not 0 <= self.standby_take_over_fraction <= 1:
            raise ConfigError("--standby-take-over-fraction must be within [0, 1]")
        if (
            min(
                self.rebalance_period_s,
                self.rebalance_min_gain,
                self.rebalance_loss_watch_s,
                self.rebalance_loss_delay_s,
            )
            < 0
        ):
            raise ConfigError(
                "--rebalance-period-s, --rebalance-min-gain, --rebalance-loss-watch-s and "
                "--rebalance-loss-delay-s must be >= 0"
            )
        if self.averaging_every_steps is not None:
            if self.averaging_period_s is not None:
                raise ConfigError(
                    "--averaging-period-s and --averaging-every-steps both set the averaging schedule; give one"
                )
            if self.averaging != "periodic":
                raise ConfigError(
                    "--averaging-every-steps schedules periodic averaging: use it with --averaging periodic"
                )
            if self.averaging_every_steps < 1:
                raise ConfigError("--averaging-every-steps must be at least 1")
        elif self.averaging_period_s is None:
            self.averaging_period_s = DEFAULT_AVERAGING_PERIOD_S
        for name in (
            "lr",
            "announce_period_s",
            "averaging_timeout_s",
            "standby_refresh_s",
            "standby_check_s",
            "max_request_mb",
            "bad_request_refill_per_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.averaging_period_s is not None and self.averaging_period_s <= 0:
            raise ConfigError("averaging_period_s must be positive")
        validate_metrics_options(self.metrics_host, self.metrics_port)
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ConfigError("--memory-limit-gb must be positive")
        if self.num_layers is not None:
            if self.split_boundaries is not None:
                raise ConfigError("--num-layers and --split-boundaries both choose the split; give one")
            if self.num_layers != "auto" and not (self.num_layers.isdigit() and int(self.num_layers) >= 1):
                raise ConfigError(f"--num-layers {self.num_layers!r}: expected a positive number of blocks or auto")
        if self.outer_lr < 0 or not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError("--outer-lr must be >= 0 (0 = off) and --outer-momentum within [0, 1)")
        if self.outer_lr > 0 and self.averaging != "periodic":
            raise ConfigError("--outer-lr is an outer step of periodic averaging: use it with --averaging periodic")
        if (
            self.fault_slowdown < 1.0
            or not 0.0 <= self.fault_fail_rate <= 1.0
            or not 0.0 <= self.fault_garbage_rate <= 1.0
        ):
            raise ConfigError("--fault-slowdown must be >= 1, --fault-fail-rate and --fault-garbage-rate within [0, 1]")
        if self.link_probe_period_s < 0:
            raise ConfigError("--link-probe-period-s must be >= 0 (0 turns probing off)")
        for name in (
            "target_batch_size",
            "num_threads",
            "max_batch_size",
            "max_concurrent_requests",
            "bad_request_burst",
            "link_probe_peers",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")

    @property
    def requested_boundaries(self) -> tuple[int, ...] | None:
        if self.split_boundaries is None:
            return None
        try:
            return tuple(int(part) for part in self.split_boundaries.replace(" ", "").split(","))
        except ValueError:
            raise ConfigError(
                f"--split-boundaries {self.split_boundaries!r}: expected comma-separated block indices such as 0,4,6"
            ) from None

    @property
    def record_ttl_s(self) -> float:
        """A record outlives a few missed announcements, no more."""
        return max(3 * self.announce_period_s, 3.0)

    @property
    def averaging_schedule(self) -> AveragingSchedule:
        """When periodic averaging rounds happen: by steps if --averaging-every-steps, else by time."""
        if self.averaging_every_steps is not None:
            return AveragingSchedule(every_steps=self.averaging_every_steps)
        return AveragingSchedule(period_s=self.averaging_period_s)
