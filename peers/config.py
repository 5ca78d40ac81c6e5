"""The peer's configuration: one dataclass nested by section, filled from CLI flags and SWARM_* variables.

`PeerConfig` names what the peer serves (model, stage, split, seed); each section configures one
component and validates its own fields. Where a component already had a settings class, that class
is the section (`NetworkConfig`, `OptimizerSettings`, `FaultSettings`); the others are defined here.
A leaf field's name is its flag and its variable (`config.replicas.averaging_timeout_s` is
`--averaging-timeout-s` and `SWARM_AVERAGING_TIMEOUT_S`), so flags kept their names when they moved
into sections; `swarm peer --help` lists them in a group per section. `PeerConfig.__post_init__`
checks only the rules that span sections.

    network        how the peer joins the DHT (dht/node.py)
    compute        device, precision, threads, memory, batch and activation-cache sizes
    optim          the local optimizer (peers/compute/stage_runtime.py)
    serving        limits on what callers may send (peers/serving/admission.py)
    transport      the data plane: calls over direct TLS connections (wire/data_plane.py)
    announcing     the DHT record, the status file, the reachability check
    replicas       how replicas of a stage agree (peers/replicas/)
    placement      rebalancing moves and the standby pool (peers/placement/stage_moves.py)
    probing        link measurements for the live planner (peers/placement/link_probe.py)
    checkpointing  where and how often the stage is saved
    metrics        the Prometheus endpoint
    faults         fault injection, for tests and benchmarks: one hidden option, `--faults k=v,...`

A peer's configuration is validated here and never resolved: nothing is read from disk or the DHT.
peers/settle.py settles what the peer serves (the run's spec plus these flags), once, at start-up.
"""

from __future__ import annotations

import dataclasses

from dht.authority import RunAccessConfig
from dht.node import NetworkConfig
from dht.record_policy import MAX_RECORD_TTL_S
from models.config import lora_rank, model_names_help
from models.subspace_options import SubspaceSettings
from peers.compute.devices import DEVICE_CHOICES_HELP, PRECISION_CHOICES
from peers.compute.faults import FaultSettings
from peers.compute.stage_runtime import OptimizerSettings
from peers.compute.weight_prediction import WEIGHT_PREDICTIONS
from peers.placement.link_probe import ProbeSettings
from peers.replicas.averaging_choice import AVERAGING_TRANSPORTS, DEFAULT_LOSS_BUDGET, DEFAULT_OUTER_LR
from peers.replicas.averaging_schedule import AveragingSchedule
from peers.replicas.outer_rounds import OUTER_CODECS, OuterSchedule, PseudoGradientCodec
from peers.replicas.outer_step import OuterSettings
from peers.replicas.robust_mean import ROBUST_METHODS
from process.config import ConfigError, option, packed_section, section
from process.metrics_http import validate_metrics_options
from wire.protocol import STATE_REQUEST_INTERVAL_S

AUTO_STAGE = "auto"
DEFAULT_AVERAGING_PERIOD_S = 30.0
# outer mode's defaults (benchmarks/RESULTS.md, "Outer rounds: the in-process convergence table")
DEFAULT_OUTER_EVERY_STEPS = 100
DEFAULT_OUTER_CODEC = "int8"
MEMORY_SPLIT = "memory"  # --split-boundaries memory: the parameter-balanced split
# What `swarm peer --help` lists: where the peer is and how much it gives. The run's spec says what to
# train; every other flag still works and `swarm peer --help-all` lists them.
VOLUNTEER_OPTIONS = (
    "initial_peers",
    "run",
    "credential",
    "stage",
    "host_maddrs",
    "announce_maddrs",
    "identity_path",
    "device",
    "memory_limit_gb",
    "checkpoint_dir",
    "metrics_port",
    "verbose",
)


def _positive(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) <= 0:
            raise ConfigError(f"{name} must be positive")


def _at_least_one(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 1:
            raise ConfigError(f"{name} must be at least 1")


@dataclasses.dataclass(kw_only=True)
class ComputeSettings:
    """Where and how the stage computes, and how much it holds at once."""

    device: str = option("auto", help=f"where the stage computes: {DEVICE_CHOICES_HELP}")
    precision: str = option(
        "auto",
        help="compute precision (auto: bf16 on a GPU that has it, else fp32; bf16/fp16: autocast; weights "
        "and optimizer stay fp32; the wire format is the codec's either way)",
        choices=list(PRECISION_CHOICES),
    )
    num_threads: int = option(1, help="torch compute threads")
    memory_limit_gb: float | None = option(
        None,
        help="memory this peer may use (default: what the device has free); "
        "the peer refuses to start when its stage does not fit",
    )
    max_batch_size: int = option(256, help="largest microbatch (samples) this peer accepts")
    activation_cache_size: int = option(64, help="forward activations kept for backwards that come back here")

    def __post_init__(self) -> None:
        _at_least_one(self, "num_threads", "max_batch_size")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ConfigError("--memory-limit-gb must be positive")


@dataclasses.dataclass(kw_only=True)
class ServingLimits:
    """What one caller may send: the admission guard's limits and the concurrency of serving."""

    max_concurrent_requests: int = option(64, help="requests served at once; more wait")
    max_request_mb: float = option(64.0, help="refuse a request whose tensors carry more than this many MiB")
    max_decoded_mb: float = option(
        256.0,
        help="refuse a request whose tensors would take more than this many MiB once decoded "
        "(checked on its header, before anything is read on or decoded)",
    )
    max_in_flight_mb: float = option(
        256.0,
        help="bytes all requests being read or served may hold at once, in MiB; one caller's may hold a quarter; past "
        "that a request is refused as busy",
    )
    request_deadline_s: float = option(
        120.0,
        help="refuse a request that takes longer than this to arrive; each of its messages may take at most "
        "30 s (or this, if less)",
    )
    hop_record_mb: float = option(
        64.0,  # a `small` microbatch of 4 is 0.5 MiB of fp32 activations each way
        help="direct routing: MiB of the last chains' hop tensors (what this peer received and sent) kept for "
        "the spot checks of the trainers that ask for them (peers/serving/hop_records.py); 0 = keep none",
    )
    hop_piece_kb: int = option(
        128,
        help="direct routing: a hop larger than this many KiB crosses on several streams at once, in pieces of about "
        "this size (0 = one stream per hop)",
    )
    bad_request_burst: int = option(10, help="bad requests a caller may send in a row before it is refused for a while")
    bad_request_refill_per_s: float = option(
        0.2,
        help="bad requests per second a caller may keep sending; beyond "
        "that (after the burst) it is refused until its allowance refills",
    )

    def __post_init__(self) -> None:
        _positive(self, "max_request_mb", "max_decoded_mb", "max_in_flight_mb", "request_deadline_s")
        _positive(self, "bad_request_refill_per_s")
        if not 0 <= self.hop_piece_kb <= 4096:
            raise ConfigError(f"--hop-piece-kb must be 0 (off) or from 1 to 4096, got {self.hop_piece_kb}")
        if not self.hop_record_mb >= 0:
            raise ConfigError(f"--hop-record-mb must be >= 0, got {self.hop_record_mb:g}")
        if self.max_in_flight_mb < self.max_request_mb + 1:
            raise ConfigError(
                f"--max-in-flight-mb ({self.max_in_flight_mb:g}) must hold a request of --max-request-mb "
                f"({self.max_request_mb:g}) and its headers: give it at least {self.max_request_mb + 1:g}"
            )
        _at_least_one(self, "max_concurrent_requests", "bad_request_burst")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * (1 << 20))

    @property
    def max_decoded_bytes(self) -> int:
        return int(self.max_decoded_mb * (1 << 20))

    @property
    def max_in_flight_bytes(self) -> int:
        return int(self.max_in_flight_mb * (1 << 20))

    @property
    def max_caller_in_flight_bytes(self) -> int:
        """A quarter of the peer's budget, but always room for one request of the largest size (and its headers)."""
        return min(max(self.max_in_flight_bytes // 4, self.max_request_bytes + (1 << 20)), self.max_in_flight_bytes)


@dataclasses.dataclass(kw_only=True)
class AnnounceSettings:
    """The peer's record on the DHT, its status file, and the reachability check at start."""

    announce_period_s: float = option(5.0, help="re-announce this peer on the DHT this often")
    status_file: str | None = option(
        None,
        help="write this peer's state here as JSON at every announcement "
        "(read by `python -m peers.health`, the container's health check)",
    )
    reachability_check: str = option(
        "auto",
        help="at start, ask up to 3 online peers to dial this one back and say "
        "whether others can reach it: auto (skipped when every address is loopback, "
        "where it proves nothing), always, off",
        choices=["auto", "always", "off"],
    )

    def __post_init__(self) -> None:
        _positive(self, "announce_period_s")

    @property
    def record_ttl_s(self) -> float:
        """A record outlives a few missed announcements, no more (and never what DHT nodes store)."""
        return min(max(3 * self.announce_period_s, 3.0), MAX_RECORD_TTL_S)


@dataclasses.dataclass(kw_only=True)
class ReplicaSettings:
    """How replicas of a stage agree: averaging mode, its schedule and codec, the outer step, and
    whether a joiner first copies a live replica's state."""

    averaging: str = option(
        "auto",
        help="how replicas of a stage agree: auto (default: the stage's mode, else sync or outer from the measured "
        "links), sync (average gradients every step), outer (DiLoCo rounds), periodic or none",
        choices=["none", "sync", "periodic", "outer", "auto"],
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
        help="periodic mode: average parameters right after every this many local steps, instead of a period; "
        f"outer mode: the steps between two rounds of each fragment (default {DEFAULT_OUTER_EVERY_STEPS})",
    )
    averaging_compression: str | None = option(
        None,
        help="averaging traffic: none (default; replicas agree exactly), fp16 or int8 (fewer bytes; the replicas then "
        "agree only up to the codec's rounding)",
        choices=["none", "fp16", "int8"],
    )
    outer_lr: float | None = option(
        None,
        help="periodic and outer modes: the learning rate of a DiLoCo-style Nesterov outer step after each round "
        f"(0 = plain averaging; default: 0 for periodic, {DEFAULT_OUTER_LR:g} for outer)",
    )
    outer_momentum: float = option(0.9, help="periodic and outer modes: momentum of the outer step (with --outer-lr)")
    outer_codec: str = option(
        DEFAULT_OUTER_CODEC,
        help="outer mode: the codec of the pseudo-gradients a round exchanges: none, fp16, int8, int4 or topk "
        "(--outer-topk-fraction of the values, with error feedback)",
        choices=list(OUTER_CODECS),
    )
    outer_topk_fraction: float = option(0.01, help="outer mode with --outer-codec topk: the fraction of values sent")
    outer_error_feedback: str = option(
        "auto",
        help="outer mode: keep what the codec dropped and send it with the next round: on, off, or auto "
        "(on for topk only)",
        choices=["auto", "on", "off"],
    )
    outer_overlap: bool = option(
        False,
        help="outer mode: a round is exchanged while the next --averaging-every-steps / --outer-fragments "
        "steps compute, and applied after them (Streaming DiLoCo); off: the commit waits for the round",
    )
    outer_fragments: int = option(
        1,
        help="outer mode: rounds carry this many slices of the stage's values in turn, one every "
        "--averaging-every-steps / this many steps, so each round sends that much less",
    )
    averaging_loss_budget: float = option(
        DEFAULT_LOSS_BUDGET,
        help="--averaging auto: the validation loss against exact sync (0.01 = 1%% worse) outer rounds may cost "
        "where links are too slow for sync (no measured setting is within the default 1%%)",
    )
    averaging_timeout_s: float = option(30.0, help="give up an averaging round after this many seconds")
    averaging_matchmaking_s: float | None = option(
        None,
        help="how long hivemind's matchmaking gathers a round's group, in seconds (default 0.5 for sync and periodic "
        "by steps, 1.0 by time)",
    )
    averaging_groups: str = option(
        "trainer",
        help="sync mode: how a round's group forms: trainer (default: the group the trainer's commit names, at once) "
        "or matchmaking (hivemind's, about --averaging-matchmaking-s a round)",
        choices=["trainer", "matchmaking"],
    )
    sync_delay: int = option(
        0,
        help="sync mode: 0 = each commit waits for the replicas' all-reduce and step (exact); 1 = the update is "
        "applied at the next commit, one step late, overlapped with compute",
        choices=[0, 1],
    )
    sync_delay_from: int | None = option(
        None,
        help="with --sync-delay 1, the step the delay begins with; the steps before it are exact (default: the end of "
        "the warmup, --warmup-steps; 0: from the first step)",
    )
    weight_prediction: str = option(
        "local-step",
        help="with --sync-delay 1, what each step computes on: local-step (the parameters plus this replica's own "
        "update of the step in flight), last-update (plus the last update applied) or none",
        choices=list(WEIGHT_PREDICTIONS),
    )
    averaging_transport: str = option(
        "auto",
        help="exact sync's rounds: gloo (only without a run authority), exchange (replicas fetch each other's "
        "gradients over their own transport), hivemind, or auto (default: gloo where it may, else exchange)",
        choices=list(AVERAGING_TRANSPORTS),
    )
    robust_averaging: str = option(
        "clip",
        help="how a replica reduces its part of the all-reduce in groups of 3 or more: clip (default: CenteredClip, "
        "bounds one liar), trim (trimmed mean) or none (plain weighted mean)",
        choices=list(ROBUST_METHODS),
    )
    load_state: bool = option(True, help="on start, download the stage's current state from a live replica")

    def __post_init__(self) -> None:
        if self.averaging_every_steps is not None:
            if self.averaging_period_s is not None:
                raise ConfigError(
                    "--averaging-period-s and --averaging-every-steps both set the averaging schedule; give one"
                )
            if self.averaging not in ("periodic", "outer", "auto"):
                raise ConfigError(
                    "--averaging-every-steps schedules periodic or outer averaging: use it with --averaging "
                    "periodic or outer"
                )
            if self.averaging_every_steps < 1:
                raise ConfigError("--averaging-every-steps must be at least 1")
        elif self.averaging == "outer":
            if self.averaging_period_s is not None:
                raise ConfigError("outer rounds come every --averaging-every-steps steps, not --averaging-period-s")
        if self.averaging in ("outer", "auto"):
            try:
                self.outer_schedule  # noqa: B018 - every / fragments checked
                self.outer_codec_settings  # noqa: B018
            except ValueError as e:
                raise ConfigError(f"--averaging outer: {e}") from None
        _positive(self, "averaging_timeout_s")
        if not 0.0 <= self.averaging_loss_budget < 10.0:
            raise ConfigError("--averaging-loss-budget is a share of validation loss (0.01 = 1%), from 0 up to 10")
        if self.averaging_period_s is not None and self.averaging_period_s <= 0:
            raise ConfigError("averaging_period_s must be positive")
        if (self.outer_lr is not None and self.outer_lr < 0) or not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError("--outer-lr must be >= 0 (0 = off) and --outer-momentum within [0, 1)")
        if self.outer_lr and self.averaging not in ("periodic", "outer", "auto"):
            raise ConfigError("--outer-lr is an outer step of periodic or outer averaging: use it with one of them")
        if self.averaging_matchmaking_s is not None and self.averaging_matchmaking_s <= 0:
            raise ConfigError("--averaging-matchmaking-s must be positive")
        if self.sync_delay not in (0, 1):
            raise ConfigError("--sync-delay must be 0 (exact) or 1 (one step late, overlapped)")
        if self.sync_delay and self.averaging != "sync":
            raise ConfigError("--sync-delay delays sync averaging's update: use it with --averaging sync")
        if self.sync_delay_from is not None:
            if not self.sync_delay:
                raise ConfigError("--sync-delay-from says when --sync-delay 1 begins: use it with --sync-delay 1")
            if self.sync_delay_from < 0:
                raise ConfigError("--sync-delay-from must be 0 (the delay from the first step) or more")

    @property
    def schedule(self) -> AveragingSchedule:
        """When periodic averaging rounds happen: by steps if --averaging-every-steps, else by time."""
        if self.averaging_every_steps is not None:
            return AveragingSchedule(every_steps=self.averaging_every_steps)
        return AveragingSchedule(period_s=self.averaging_period_s or DEFAULT_AVERAGING_PERIOD_S)

    @property
    def outer(self) -> OuterSettings | None:
        """The outer step after each periodic round, or None with --outer-lr 0 (plain averaging)."""
        return OuterSettings(lr=self.outer_lr, momentum=self.outer_momentum) if self.outer_lr else None

    @property
    def outer_schedule(self) -> OuterSchedule:
        """Outer mode: when each fragment's round begins, and whether it is applied late."""
        every = self.averaging_every_steps or DEFAULT_OUTER_EVERY_STEPS
        return OuterSchedule(every_steps=every, fragments=self.outer_fragments, overlap=self.outer_overlap)

    @property
    def outer_step_settings(self) -> OuterSettings:
        """Outer mode's outer step (--outer-lr 0: the plain average, lr 1 without momentum)."""
        lr = DEFAULT_OUTER_LR if self.outer_lr is None else self.outer_lr
        return OuterSettings(lr=lr, momentum=self.outer_momentum) if lr else OuterSettings(lr=1.0, momentum=0.0)

    @property
    def outer_codec_settings(self) -> PseudoGradientCodec:
        feedback = {"auto": None, "on": True, "off": False}[self.outer_error_feedback]
        return PseudoGradientCodec(self.outer_codec, topk_fraction=self.outer_topk_fraction, error_feedback=feedback)


@dataclasses.dataclass(kw_only=True)
class PlacementSettings:
    """When a serving peer moves to another stage, and how a standby peer waits for one."""

    rebalance_period_s: float = option(
        0.0,
        help="check about this often (randomised) whether moving to another stage raises the swarm's bottleneck, and "
        "move if so (0 = never move)",
    )
    rebalance_loss_watch_s: float = option(
        5.0,
        help="with --rebalance-period-s: also re-read the swarm this often, and check within --rebalance-loss-delay-s "
        "when a stage lost a replica (0 = periodic only)",
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
    standby_refresh_s: float = option(
        30.0,
        help="standby: re-download the held stage's state at most this often, when its replicas "
        f"announce steps the copy lacks (at least {STATE_REQUEST_INTERVAL_S:.0f}: a replica sends one "
        "caller its state no more often)",
    )
    standby_check_s: float = option(2.0, help="standby: look for a stage that needs taking over this often")
    standby_take_over_fraction: float = option(
        0.5,
        help="standby: also take over a stage whose throughput fell below "
        "this fraction of the other stages' mean (0 = only a stage left "
        "without an online replica)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.standby_take_over_fraction <= 1:
            raise ConfigError("--standby-take-over-fraction must be within [0, 1]")
        rebalancing = (
            self.rebalance_period_s,
            self.rebalance_min_gain,
            self.rebalance_loss_watch_s,
            self.rebalance_loss_delay_s,
        )
        if min(rebalancing) < 0:
            raise ConfigError(
                "--rebalance-period-s, --rebalance-min-gain, --rebalance-loss-watch-s and "
                "--rebalance-loss-delay-s must be >= 0"
            )
        _positive(self, "standby_refresh_s", "standby_check_s")
        if self.standby_refresh_s < STATE_REQUEST_INTERVAL_S:
            raise ConfigError(
                f"--standby-refresh-s must be at least {STATE_REQUEST_INTERVAL_S:.0f}: a replica sends one caller "
                "its state no more often (it would refuse the other downloads)"
            )


@dataclasses.dataclass(kw_only=True)
class ProbingSettings:
    """How often the peer measures its links to others (the rest of `ProbeSettings` keeps its defaults)."""

    link_probe_period_s: float = option(
        60.0,
        help="measure round-trip time and bandwidth to a few other peers about "
        "this often (randomized) and publish them for `swarm plan --from-dht`; 0 = off",
    )
    link_probe_peers: int = option(8, help="peers probed per round, at most")

    def __post_init__(self) -> None:
        if self.link_probe_period_s < 0:
            raise ConfigError("--link-probe-period-s must be >= 0 (0 turns probing off)")
        _at_least_one(self, "link_probe_peers")

    @property
    def probe(self) -> ProbeSettings | None:
        """The prober's settings, or None when probing is off."""
        if self.link_probe_period_s <= 0:
            return None
        return ProbeSettings(period_s=self.link_probe_period_s, max_peers=self.link_probe_peers)


@dataclasses.dataclass(kw_only=True)
class DataPlaneSettings:
    """Calls over direct TLS connections instead of p2pd (wire/data_plane.py); p2pd stays the fallback."""

    data_plane: bool = option(
        True,
        help="serve trainers and peers that reach this peer directly over TLS on a port of its own "
        "(announced to them over p2pd), p2pd carrying the rest; --no-data-plane: p2pd only",
    )
    data_plane_port: int = option(
        0,
        help="TCP port of the data plane on the hosts of --host-maddrs (0 = any free port; behind a port map, map it too)",
    )
    data_plane_announce_port: int = option(
        0, help="the port callers dial, when a port map forwards it to --data-plane-port (0 = that port)"
    )

    def __post_init__(self) -> None:
        for flag, port in (
            ("--data-plane-port", self.data_plane_port),
            ("--data-plane-announce-port", self.data_plane_announce_port),
        ):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{flag} must be a TCP port (0-65535), not {port}")


@dataclasses.dataclass(kw_only=True)
class CheckpointSettings:
    checkpoint_dir: str | None = option(
        None, help="save the stage here (atomically) periodically and on exit; restore from it at start"
    )
    checkpoint_period_s: float = option(300.0, help="seconds between periodic checkpoints (with --checkpoint-dir)")


@dataclasses.dataclass(kw_only=True)
class MetricsSettings:
    metrics_port: int = option(
        0,
        help="serve Prometheus metrics on this port (0 = any free port, announced in the "
        "peer's DHT record for `swarm monitor targets`; -1 = off)",
    )
    metrics_host: str = option("127.0.0.1", help="interface the metrics endpoint listens on (0.0.0.0 = all)")

    def __post_init__(self) -> None:
        validate_metrics_options(self.metrics_host, self.metrics_port)


@dataclasses.dataclass(kw_only=True)
class PeerConfig:
    model: str = option(
        "small",
        help=f"{model_names_help()} (default: the folder's)",
    )
    model_dir: str | None = option(
        None,
        help="a Hugging Face model folder (GPT-2 or Llama: config.json, safetensors weights): the "
        "model's architecture, sizes and weights; this peer reads only its stage's tensors",
    )
    vocab_size: int | None = option(
        None,
        help="vocabulary size of the model (default: the model's own); must match the trainer's data "
        "(`swarm data prepare` prints it)",
    )
    trainable: str = option(
        "all",
        help="what is trained: all (every weight) or lora:R (rank-R LoRA adapters on the blocks, base weights frozen; "
        "needs peft); every peer and the trainer of a swarm must use the same",
    )
    stage: str | int = option(
        AUTO_STAGE,
        help="the pipeline stage to serve, 0-based, or auto: the stage that needs a peer most and fits in memory",
    )
    num_stages: int = option(2, help="number of pipeline stages the model is split into")
    seed: int = option(0, help="seed of the initial weights; every peer of a swarm must use the same")
    num_layers: str | None = option(
        None,
        help="blocks per stage: N, or auto (the most that fit in memory); "
        "sets --num-stages to the equal split with stages of at most that many blocks",
    )
    split_boundaries: str | None = option(
        None,
        help="block boundaries of the stage split, e.g. 0,4,6 (from `swarm profile`), or memory (equal shares of the "
        "parameters); default: the swarm's split, or the equal split",
    )
    init_weights: str | None = option(
        None,
        help="a local .safetensors file with the whole model's initial weights "
        "(names as in models.stages.build_full_model); this stage loads its part",
    )
    network: NetworkConfig = section(NetworkConfig, help="how the peer joins the swarm's DHT")
    authority: RunAccessConfig = section(RunAccessConfig, help="the run this peer serves, and its credential")
    compute: ComputeSettings = section(ComputeSettings, help="where and how the stage computes")
    optim: OptimizerSettings = section(OptimizerSettings, help="the stage's local optimizer")
    serving: ServingLimits = section(ServingLimits, help="limits on what callers may send")
    transport: DataPlaneSettings = section(
        DataPlaneSettings, help="direct TLS connections for calls, p2pd the fallback"
    )
    announcing: AnnounceSettings = section(AnnounceSettings, help="the peer's DHT record and status file")
    replicas: ReplicaSettings = section(ReplicaSettings, help="how replicas of a stage agree")
    placement: PlacementSettings = section(PlacementSettings, help="rebalancing moves and the standby pool")
    probing: ProbingSettings = section(ProbingSettings, help="link measurements for `swarm plan --from-dht`")
    checkpointing: CheckpointSettings = section(CheckpointSettings, help="saving and restoring the stage")
    metrics: MetricsSettings = section(MetricsSettings, help="the Prometheus endpoint")
    faults: FaultSettings = packed_section(
        FaultSettings,
        prefix="fault_",
        help="developer: fault injection for tests and benchmarks, e.g. slowdown=3,fail_rate=0.1 (the fields "
        "of peers/compute/faults.py's FaultSettings without fault_)",
    )
    subspace: SubspaceSettings = section(SubspaceSettings, help="what crosses between stages: K coefficients per token")

    def __post_init__(self) -> None:
        """Syntax and the rules between options only: the model, the split and the stage are settled
        against the run's spec at start-up (peers/settle.py), where files and the DHT are read."""
        try:
            lora_rank(self.trainable)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.model_dir is not None and self.init_weights is not None:
            raise ConfigError("--model-dir and --init-weights both give the initial weights; give one")
        if self.replicas.averaging_transport == "gloo" and self.authority.run is not None:
            raise ConfigError(
                "--averaging-transport gloo authenticates nobody: a run with an authority (--run) averages by exchange"
            )
        if self.placement.standby:
            if self.stage != AUTO_STAGE:
                raise ConfigError("--standby chooses its stage itself: leave out --stage (or say --stage auto)")
        if self.stage != AUTO_STAGE:
            try:
                self.stage = int(self.stage)
            except ValueError:
                raise ConfigError(f"--stage {self.stage!r}: expected a stage number or auto") from None
            if self.stage < 0:
                raise ConfigError(f"--stage {self.stage}: stages are numbered from 0")
        if self.num_stages < 1:
            raise ConfigError(f"--num-stages {self.num_stages}: a model has at least one stage")
        self.requested_boundaries  # noqa: B018 - refuses malformed --split-boundaries now, in one line
        if self.num_layers is not None:
            if self.split_boundaries is not None:
                raise ConfigError("--num-layers and --split-boundaries both choose the split; give one")
            if self.num_layers != "auto" and not (self.num_layers.isdigit() and int(self.num_layers) >= 1):
                raise ConfigError(f"--num-layers {self.num_layers!r}: expected a positive number of blocks or auto")

    @property
    def exact_steps_before_delay(self) -> int:
        """With --sync-delay 1, the stage's steps that take the exact barrier before the delay begins:
        --sync-delay-from, or by default the learning-rate warmup's steps (0 without --sync-delay)."""
        if not self.replicas.sync_delay:
            return 0
        begins = self.replicas.sync_delay_from
        return self.optim.warmup_steps if begins is None else begins

    @property
    def requested_boundaries(self) -> tuple[int, ...] | None:
        """The boundaries --split-boundaries names (None: none given, or `memory`, which the model decides)."""
        if self.split_boundaries is None or self.split_boundaries.strip() == MEMORY_SPLIT:
            return None
        try:
            return tuple(int(part) for part in self.split_boundaries.replace(" ", "").split(","))
        except ValueError:
            raise ConfigError(
                f"--split-boundaries {self.split_boundaries!r}: expected comma-separated block indices such as 0,4,6"
            ) from None
