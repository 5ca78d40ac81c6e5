"""The trainer: holds no weights; reads the corpus, streams each step's microbatches through the
swarm, and reports loss and throughput."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field

import hivemind
import torch

from dht.announce import fetch_stage_records_async
from dht.node import start_dht
from dht.records import PeerState
from dht.split_agreement import SplitConflictError, fetch_split_records_async, split_in_force
from models.config import get_model_config
from process.metrics_http import serve_metrics
from swarm.trainer.client import StageClient
from swarm.trainer.codec_policy import CodecPolicy
from swarm.trainer.config import TrainerConfig
from swarm.trainer.data import MicrobatchSampler, load_corpus
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.pipeline import SwarmPipeline
from swarm.trainer.progress import StepProgress, TrainingProgress


class DiscoveryError(RuntimeError):
    """No usable peers of the model were found."""


class ResumeError(RuntimeError):
    """An earlier run's report cannot be resumed from."""


@dataclass
class TrainingReport:
    model: str
    num_stages: int
    steps: int = 0
    tokens: int = 0
    initial_loss: float | None = None
    final_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    train_time_s: float = 0.0
    microbatches_sent: int = 0
    microbatches_retried: int = 0
    microbatches_lost: int = 0
    calls_retried: int = 0
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    calls_by_peer: dict[str, int] = field(default_factory=dict)
    tokens_per_s_by_step: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)  # seconds since training started
    completed: bool = False
    resumed_from_step: int = 0
    codec: str = "none"
    bytes_by_codec: dict = field(default_factory=dict)  # payload bytes sent/received, per codec
    wire_bytes_per_token: float = 0.0
    backward_inputs_skipped: int = 0  # backwards served from the forward peer's activation cache, inputs not resent
    backward_inputs_resent: int = 0  # ... tried without inputs, then resent them after a cache miss
    split_boundaries: list[int] | None = None  # the stage split the peers agreed on (None: none stated)

    @classmethod
    def load(cls, path: str, *, model: str) -> TrainingReport:
        """The report of an earlier run, to resume it; raises ResumeError if it cannot be used."""
        try:
            with open(path) as f:
                data = json.load(f)
            report = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError) as e:
            raise ResumeError(f"cannot resume from {path!r}: {e}") from None
        if report.model != model:
            raise ResumeError(f"{path!r} is a report of {report.model}, not {model}")
        report.completed = False
        return report

    def write(self, path: str) -> None:
        """Write atomically: a reader never sees half a report."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)


async def discover_num_stages(dht: hivemind.DHT, model: str, timeout_s: float, say=print) -> int:
    deadline = time.monotonic() + timeout_s
    announced = False
    while time.monotonic() < deadline:
        records = [r for r in await fetch_stage_records_async(dht, model, 0) if r.state == PeerState.ONLINE]
        if records:
            counts = sorted({r.num_stages for r in records})
            if len(counts) > 1:
                say(
                    f"peers of {model} disagree on the number of stages {counts}; using {counts[-1]} (pass --num-stages)"
                )
            return counts[-1]
        if not announced:
            say(f"waiting for peers of {model} to appear on the DHT...")
            announced = True
        await asyncio.sleep(1.0)
    raise DiscoveryError(f"no peer serving {model} stage 0 appeared within {timeout_s:.0f} s")


async def read_split(dht: hivemind.DHT, model: str, num_stages: int) -> list[int] | None:
    """The split the peers serve; a `DiscoveryError` if they disagree or it has another number of stages."""
    try:
        split = split_in_force(await fetch_split_records_async(dht, model))
    except SplitConflictError as e:
        raise DiscoveryError(str(e)) from None
    if split is not None and split.num_stages != num_stages:
        raise DiscoveryError(f"the peers serve {model} in {split.describe()}, not in {num_stages} stages")
    return list(split.boundaries) if split is not None else None


async def wait_for_every_stage(pipeline: SwarmPipeline, timeout_s: float, say=print) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        await pipeline.refresh()
        counts = pipeline.live_replicas()
        if all(counts):
            return
        if time.monotonic() > deadline:
            missing = [s for s, n in enumerate(counts) if not n]
            raise DiscoveryError(f"stages {missing} have no online peer after {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def train(
    config: TrainerConfig, dht: hivemind.DHT, report: TrainingReport, say=print, metrics: TrainerMetrics | None = None
) -> TrainingReport:
    """Train for `config.steps` steps, filling `report` as it goes (it stays valid on failure)."""
    metrics = metrics or TrainerMetrics()
    # A bar only where our lines go straight to a terminal; a caller's own `say` gets plain lines.
    progress = TrainingProgress(
        config.steps, log_every=config.log_every, say=say, interactive=say is print and sys.stdout.isatty()
    )
    say = progress.say
    model_config = get_model_config(config.model)
    tokens = load_corpus(config.data)
    sampler = MicrobatchSampler(
        tokens,
        seq_len=model_config.seq_len,
        batch_size=config.batch_size,
        microbatch_size=config.microbatch_size,
        seed=config.seed,
    )
    num_stages = config.num_stages or await discover_num_stages(dht, config.model, config.discovery_timeout_s, say)
    p2p = await dht.replicate_p2p()
    client = StageClient(p2p, model=config.model, num_stages=num_stages)
    pipeline = SwarmPipeline(
        dht,
        client,
        model=config.model,
        num_stages=num_stages,
        d_model=model_config.d_model,
        seq_len=model_config.seq_len,
        max_retries=config.max_retries,
        stage_wait_timeout_s=config.stage_wait_timeout_s,
        max_in_flight=config.max_in_flight,
        run_id=secrets.token_hex(4),
        on_wait=say,
        codecs=CodecPolicy(config.codec, topk_fraction=config.topk_fraction),
        metrics=metrics,
    )
    pipeline.codecs.warm_up()
    metrics.set_run(model=config.model, num_stages=num_stages, codec=config.codec, target_steps=config.steps)
    metrics.count_bytes(client.bytes.snapshot)
    await wait_for_every_stage(pipeline, config.discovery_timeout_s, say)
    report.split_boundaries = await read_split(dht, config.model, num_stages)  # every stage's peers stated theirs
    say(
        f"training {config.model} over {num_stages} stages with {pipeline.live_replicas()} replicas; "
        f"{len(tokens):,} tokens of data, batch {config.batch_size} x {model_config.seq_len} tokens"
    )
    report.num_stages = num_stages
    refresher = asyncio.create_task(pipeline.refresh_forever(config.refresh_period_s))
    tokens_per_step = config.batch_size * model_config.seq_len
    started = time.perf_counter()
    try:
        first_step = report.steps  # > 0 when resuming: continue from the same data position
        if first_step:
            say(f"resuming at step {first_step} of {config.steps}")
        for step in range(first_step, config.steps):
            step_started = time.perf_counter()
            loss = await pipeline.run_step(sampler.batch(step))
            step_s = time.perf_counter() - step_started
            report.steps, report.tokens = step + 1, (step + 1) * tokens_per_step
            report.losses.append(loss)
            report.tokens_per_s_by_step.append(tokens_per_step / step_s)
            report.step_end_s.append(time.perf_counter() - started)
            if config.report:  # after every step, so a killed trainer can resume where it was
                _fill_report(report, pipeline, time.perf_counter() - started)
                report.write(config.report)
            metrics.observe_step(step=step + 1, loss=loss, tokens=tokens_per_step, duration_s=step_s)
            elapsed = time.perf_counter() - started
            progress.update(
                StepProgress(
                    step=step + 1,
                    total_steps=config.steps,
                    loss=loss,
                    tokens_per_s=(step + 1 - first_step) * tokens_per_step / elapsed,
                    live_replicas=pipeline.live_replicas(),
                    calls_retried=pipeline.counters.calls_retried,
                    elapsed_s=elapsed,
                )
            )
        report.completed = True
    finally:
        progress.close()
        refresher.cancel()
        _fill_report(report, pipeline, time.perf_counter() - started)
    return report


def _fill_report(report: TrainingReport, pipeline: SwarmPipeline, train_time_s: float) -> None:
    counters = pipeline.counters
    report.train_time_s = train_time_s
    report.codec = pipeline.codecs.mode
    report.bytes_by_codec = pipeline.client.bytes.snapshot()
    total_bytes = sum(item["wire_bytes"] for direction in report.bytes_by_codec.values() for item in direction.values())
    report.wire_bytes_per_token = total_bytes / report.tokens if report.tokens else 0.0
    if report.losses:
        report.initial_loss = report.losses[0]
        tail = report.losses[-min(5, len(report.losses)) :]
        report.final_loss = sum(tail) / len(tail)
    timed_tokens = report.tokens - report.resumed_from_step * (report.tokens // max(report.steps, 1))
    report.tokens_per_s = timed_tokens / report.train_time_s if report.train_time_s > 0 else 0.0
    report.microbatches_sent = counters.microbatches_sent
    report.microbatches_retried = counters.microbatches_retried
    report.microbatches_lost = counters.microbatches_sent - counters.microbatches_done
    report.calls_retried = counters.calls_retried
    report.backward_inputs_skipped = counters.backward_inputs_skipped
    report.backward_inputs_resent = counters.backward_inputs_resent
    report.failures_by_kind = dict(counters.failures_by_kind)
    report.calls_by_peer = dict(counters.calls_by_peer)


def run_trainer(config: TrainerConfig, say=print) -> TrainingReport:
    """Join the DHT as a client, train, write the report (also after an error or Ctrl-C)."""
    # The trainer only encodes, decodes and checks tensors: one torch thread. More threads spin
    # against the peers' compute on shared cores (measured: int8 encode 4.6 ms with 1 thread,
    # 54 ms with 2 on the busy 2-core machine).
    torch.set_num_threads(1)
    metrics = TrainerMetrics()
    endpoint = serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)  # before the DHT: fails fast
    if endpoint:
        say(f"metrics on {endpoint.url}")
    report = TrainingReport(model=config.model, num_stages=config.num_stages or 0)
    if config.resume:
        report = TrainingReport.load(config.report, model=config.model)
        report.resumed_from_step = report.steps
    dht = start_dht(config, client_mode=True)
    try:
        asyncio.run(train(config, dht, report, say, metrics=metrics))
    finally:
        dht.shutdown()
        if endpoint:
            endpoint.close()
        if config.report:
            report.write(config.report)
    return report
