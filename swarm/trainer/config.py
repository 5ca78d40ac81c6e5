"""The trainer's configuration: one dataclass nested by section, filled from CLI flags and SWARM_*
environment variables (process/config.py derives both from the leaf fields, whose names are the
flags' names: `batch.batch_size` is `--batch-size` and SWARM_BATCH_SIZE).

Sections, one per component that reads them:
- `network` (dht/node.py's NetworkConfig): how the trainer joins the DHT;
- `corpus`: what it trains on (swarm/trainer/data.py);
- `schedule`: steps and microbatches (swarm/trainer/schedule.py);
- `discovery`: how it finds the stages' replicas (swarm/trainer/discovery.py);
- `failover`: how long it retries and waits for a failing stage (swarm/trainer/stage_call.py);
- `transport`: whether calls go over the peers' data plane (wire/transport.py);
- `compression`: the codec on the wire (wire/compression/policy.py);
- `verification`: spot checks of replicas' answers (swarm/trainer/spot_checks.py);
- `reporting`: the JSON report, progress lines and the Prometheus endpoint.
Each section validates its own fields.
"""

from __future__ import annotations

import dataclasses
import math
import os

from dht.authority import RunAccessConfig
from dht.node import NetworkConfig
from models.config import lora_rank, model_names_help
from models.subspace_options import SubspaceSettings
from process.config import ConfigError, option, section
from process.metrics_http import validate_metrics_options
from wire.compression.policy import CODEC_MODES


@dataclasses.dataclass(kw_only=True)
class CorpusSettings:
    data: str | None = option(
        None,
        help="a folder made by `swarm data prepare`, or a text file (prepared with the byte tokenizer "
        "into ~/.cache/swarm); default: the Shakespeare corpus, bytes",
    )
    seed: int = option(0, help="seed of the data order")
    data_shard: str = option(
        "0/1",
        help="I/N: read only the I-th of N equal, disjoint parts of the training split (0-based), so that "
        "N trainers on one run see different data; the validation split is read whole by every trainer",
    )

    def __post_init__(self) -> None:
        if self.data is not None and not os.path.exists(self.data):
            raise ConfigError(f"--data {self.data!r}: no such file or prepared data folder")
        self.shard  # noqa: B018 - refuses a malformed --data-shard now, in one line

    @property
    def shard(self) -> tuple[int, int]:
        """(I, N) of --data-shard."""
        index, _, count = self.data_shard.partition("/")
        if not (index.strip().isdigit() and count.strip().isdigit()) or not 0 <= int(index) < int(count):
            raise ConfigError(f"--data-shard {self.data_shard!r}: expected I/N with 0 <= I < N, e.g. 0/2 and 1/2")
        return int(index), int(count)


@dataclasses.dataclass(kw_only=True)
class EvaluationSettings:
    eval_every: int = option(
        0, help="every N steps (and after the last), compute the validation loss through the swarm; 0 = never"
    )
    eval_batches: int = option(4, help="validation batches (of --batch-size samples) per evaluation")

    def __post_init__(self) -> None:
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ConfigError("--eval-every must be at least 0 and --eval-batches at least 1")


ROUTINGS = ("hub", "direct")
# outer-rounds replicas' commits: each step waits for them, or the next step starts while they travel
OUTER_COMMITS = ("wait", "background")
DEFAULT_ROUTING = "direct"  # the one default: the CLI's, `connect`'s and `StepSchedule`'s
DEFAULT_OUTER_COMMITS = "background"  # likewise


@dataclasses.dataclass(kw_only=True)
class ScheduleSettings:
    steps: int = option(100, help="optimizer steps to train")
    batch_size: int = option(
        32, help="samples per step; peers step after --target-batch-size samples (keep them equal)"
    )
    microbatch_size: int = option(4, help="samples per microbatch sent through the pipeline")
    max_in_flight: int = option(8, help="microbatches in the pipeline at once")
    routing: str = option(
        DEFAULT_ROUTING,
        help="how activations travel: direct (peer to peer, each boundary once) or hub (every call from and back to "
        "the trainer: twice the bytes, a lie caught before it is applied)",
        choices=ROUTINGS,
    )
    hub_timing_fraction: float = option(
        0.0,
        help="with --routing direct: send this fraction of the microbatches through the trainer, as hub routing does, "
        "so that it times every stage's replicas itself (0: off)",
    )
    stop_timeout_s: float = option(
        30.0,
        help="on SIGTERM or Ctrl-C, wait this long for the step in flight before stopping (a second signal: at once)",
    )
    clip_grad_norm: float = option(
        0.0,
        help="clip each step's gradient to this norm over every stage together, as one process's clip_grad_norm_ would "
        "(0 = off; sync replicas only; one more round trip a step)",
    )
    outer_commits: str = option(
        DEFAULT_OUTER_COMMITS,
        help="outer-rounds replicas: background (the next step starts while their commit travels; each replica "
        "handles it before that step's calls) or wait (each step waits for it)",
        choices=OUTER_COMMITS,
    )

    def __post_init__(self) -> None:
        if self.stop_timeout_s < 0:
            raise ConfigError("--stop-timeout-s must be at least 0")
        if not 0.0 <= self.hub_timing_fraction <= 1.0:
            raise ConfigError("--hub-timing-fraction must lie in [0, 1]")
        if not 0.0 <= self.clip_grad_norm < float("inf"):
            raise ConfigError("--clip-grad-norm must be a finite number >= 0 (0 = off)")
        if self.steps < 1 or self.batch_size < 1 or self.microbatch_size < 1 or self.max_in_flight < 1:
            raise ConfigError("steps, batch_size, microbatch_size and max_in_flight must be at least 1")
        if self.batch_size % self.microbatch_size:
            raise ConfigError(
                f"batch_size {self.batch_size} must be a multiple of microbatch_size {self.microbatch_size}"
            )


@dataclasses.dataclass(kw_only=True)
class DiscoverySettings:
    refresh_period_s: float = option(3.0, help="re-read the peers' records from the DHT this often")
    discovery_timeout_s: float = option(120.0, help="give up if no peer of the model appears within this time")


@dataclasses.dataclass(kw_only=True)
class FailoverSettings:
    max_retries: int = option(8, help="retries of one call on other replicas before waiting for the stage")
    stage_wait_timeout_s: float = option(300.0, help="give up if a stage has no live replica for this long")


@dataclasses.dataclass(kw_only=True)
class TransportSettings:
    data_plane: bool = option(
        True,
        help="call peers over their data plane (direct TLS, wire/data_plane.py) when they are reachable "
        "directly, p2pd otherwise; --no-data-plane: p2pd only",
    )


@dataclasses.dataclass(kw_only=True)
class CompressionSettings:
    codec: str = option(
        "none",
        help="compression of activations and gradients on the wire: none, fp16, int8, "
        "int4 (blockwise 4-bit), topk, or adaptive (per link, from its measured bandwidth)",
        choices=CODEC_MODES,
    )
    topk_fraction: float = option(0.1, help="fraction of values top-k keeps (with --codec topk)")
    codec_loss_budget: float = option(
        0.02,
        help="with --codec adaptive: the validation-loss cost the chosen codecs may add (0.02: 2%% worse at equal "
        "tokens; inf: no budget)",
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ConfigError("topk_fraction must lie in (0, 1]")
        if not (
            self.codec_loss_budget >= 0.0 and (self.codec_loss_budget <= 1.0 or math.isinf(self.codec_loss_budget))
        ):
            raise ConfigError("--codec-loss-budget must be a fraction within [0, 1], or inf for none")


@dataclasses.dataclass(kw_only=True)
class VerificationSettings:
    verify_fraction: float = option(
        0.0,
        help="spot checks: the fraction of the training compute a second replica recomputes (more replicas when "
        "answers differ); the replicas in the minority are banned for the run",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ConfigError("--verify-fraction must lie in [0, 1]")


@dataclasses.dataclass(kw_only=True)
class ReportingSettings:
    report: str | None = option(None, help="write a JSON report of the run to this file")
    resume: bool = option(False, help="continue the run recorded in --report from its last step (same data position)")
    log_every: int = option(
        1, help="print progress every N steps (when stdout is not a terminal; a terminal gets a progress bar)"
    )
    metrics_port: int = option(
        0, help="serve Prometheus metrics on this port (0 = any free port, printed at start; -1 = off)"
    )
    metrics_host: str = option("127.0.0.1", help="interface the metrics endpoint listens on (0.0.0.0 = all)")

    def __post_init__(self) -> None:
        if self.resume and not (self.report and os.path.isfile(self.report)):
            raise ConfigError("--resume needs --report pointing at the report of the run to continue")
        validate_metrics_options(self.metrics_host, self.metrics_port)


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    model: str = option("small", help=f"{model_names_help()}; must match the peers'")
    model_dir: str | None = option(
        None,
        help="the Hugging Face model folder the peers serve (--model-dir of `swarm peer`): its config gives the model",
    )
    trainable: str = option(
        "all",
        help="what is trained: all (every weight) or lora:R (rank-R LoRA adapters on the blocks, base weights frozen; "
        "needs peft); every peer and the trainer of a swarm must use the same",
    )
    num_stages: int | None = option(None, help="number of stages (default: read from the peers' records)")
    network: NetworkConfig = section(NetworkConfig, help="joining the swarm's DHT")
    authority: RunAccessConfig = section(RunAccessConfig, help="the run trained, and this trainer's credential")
    corpus: CorpusSettings = section(CorpusSettings, help="the text trained on")
    schedule: ScheduleSettings = section(ScheduleSettings, help="steps, batches and microbatches")
    evaluation: EvaluationSettings = section(EvaluationSettings, help="validation loss through the swarm")
    discovery: DiscoverySettings = section(DiscoverySettings, help="finding the stages' replicas on the DHT")
    failover: FailoverSettings = section(FailoverSettings, help="retrying failed calls and waiting for stages")
    transport: TransportSettings = section(TransportSettings, help="how calls reach the peers: the data plane, or p2pd")
    compression: CompressionSettings = section(CompressionSettings, help="compression on the wire")
    verification: VerificationSettings = section(VerificationSettings, help="spot checks of replicas' answers")
    reporting: ReportingSettings = section(ReportingSettings, help="report file, progress lines and metrics")
    subspace: SubspaceSettings = section(SubspaceSettings, help="what crosses between stages: K coefficients per token")

    def __post_init__(self) -> None:
        """Syntax only: the model is settled against the run's spec at start (swarm/trainer/settle.py)."""
        try:
            lora_rank(self.trainable)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.num_stages is not None and self.num_stages < 1:
            raise ConfigError("num_stages must be at least 1")
