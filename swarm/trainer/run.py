"""The trainer: holds no weights; reads the corpus, streams each step's microbatches through the
swarm, and reports loss and throughput.

`train` composes the three parts of the pipeline: the `SwarmView` (discovery.py: which replicas
serve each stage), the `StageCaller` (stage_call.py: one call to a stage, with failover and the
encoding of what it sends) and the `StepSchedule` (schedule.py: a step's microbatches through the
stages and back, then the commit)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field

import hivemind
import torch

from dht.authority import (
    NO_RUN_WARNING,
    ROLES,
    RunAccess,
    RunAccessConfig,
    RunInfo,
    credential_summary,
    load_run_access,
)
from dht.node import protect_models, start_dht, with_p2p_client
from dht.signing import identity_of
from models.config import GPTConfig
from models.model_source import model_hash
from models.stages import boundary_width
from process.atomic_files import remove_stale_temporaries, write_atomically
from process.lifetime import stop_events_in_loop
from process.metrics_http import serve_metrics
from swarm.trainer.call_engine import CallCounters
from swarm.trainer.client import StageClient
from swarm.trainer.config import (
    DEFAULT_OUTER_COMMITS,
    DEFAULT_ROUTING,
    CompressionSettings,
    DiscoverySettings,
    FailoverSettings,
    TrainerConfig,
    VerificationSettings,
)
from swarm.trainer.data import MicrobatchSampler, ValidationBatches, model_tokenizer, open_data
from swarm.trainer.discovery import SwarmView, discover_num_stages, read_split, wait_for_every_stage
from swarm.trainer.global_step import SharedProgress
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.progress import StepProgress, TrainingProgress
from swarm.trainer.schedule import StepSchedule
from swarm.trainer.settle import find_spec, follow_versions, settle_trainer
from swarm.trainer.stage_averaging import averaging_by_stage
from swarm.trainer.stage_call import StageCaller
from wire.compression.policy import CodecPolicy
from wire.transport_stats import TRANSPORTS


class ResumeError(RuntimeError):
    """An earlier run's report cannot be resumed from."""


@dataclass(kw_only=True)
class TrainingReport(CallCounters):
    """The run's JSON report: what its calls counted (the fields of `CallCounters`, swarm/trainer/
    call_engine.py, the one set the trainer keeps), and the run's progress and results."""

    model: str
    num_stages: int
    steps: int = 0
    tokens: int = 0
    initial_loss: float | None = None
    final_loss: float | None = None
    losses: list[float] = field(default_factory=list)  # per step (with a global step: each one we sent samples in)
    tokens_per_s: float = 0.0
    train_time_s: float = 0.0
    microbatches_lost: int = 0
    tokens_per_s_by_step: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)  # seconds since training started
    completed: bool = False
    resumed_from_step: int = 0
    codec: str = "none"
    # Payload bytes this trainer sent/received, per codec: with --routing direct its own links only (token
    # ids, targets, validation passes); the hops between peers are in their swarm_peer_*_bytes_total.
    bytes_by_codec: dict = field(default_factory=dict)
    # the streamed calls this trainer made per transport ("direct": the peers' data plane, "p2pd"):
    # {"calls": n, "sent_bytes": n, "received_bytes": n}
    transports: dict = field(default_factory=dict)
    wire_bytes_per_token: float = 0.0
    grad_norms: list[float] = field(default_factory=list)  # --clip-grad-norm: each step's global norm, unclipped
    split_boundaries: list[int] | None = None  # the stage split the peers agreed on (None: none stated)
    eval_losses: list[list[float]] = field(default_factory=list)  # [step, validation loss] per evaluation
    final_eval_loss: float | None = None
    stopped_early: bool = False  # stopped by SIGTERM/SIGINT before its last step
    foreign_peers_skipped: int = 0  # peers whose records announced another model: never routed to
    # peer id -> what it did for this trainer: samples_served, calls_answered, calls_failed,
    # calls_verified, mismatches, samples_verified, disputes, stage, banned (reason or None);
    # swarm/trainer/contributions.py
    contributions: dict[str, dict] = field(default_factory=dict)
    # spot checks whose two answers differed with no third replica to tell which was right, the latest
    # (swarm/trainer/spot_checks.py `Dispute`): stage, call, microbatch_id, peers, share, step
    disputes: list[dict] = field(default_factory=list)
    # how each stage's replicas agree (mode, outer rounds' settings) and why, as their records say at the end
    averaging_by_stage: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str, *, model: str | None = None) -> TrainingReport:
        """The report of an earlier run, to resume it; raises ResumeError if it cannot be used."""
        try:
            with open(path) as f:
                data = json.load(f)
            report = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError) as e:
            raise ResumeError(f"cannot resume from {path!r}: {e}") from None
        if model is not None and report.model != model:
            raise ResumeError(f"{path!r} is a report of {report.model}, not {model}")
        report.completed = report.stopped_early = False
        return report

    def write(self, path: str) -> None:
        """Write atomically: a reader never sees half a report."""
        write_atomically(path, json.dumps(asdict(self), indent=2))


async def train(
    config: TrainerConfig,
    dht: hivemind.DHT,
    report: TrainingReport,
    say=print,
    metrics: TrainerMetrics | None = None,
    stop: asyncio.Event | None = None,
    alone: asyncio.Event | None = None,
    given: frozenset[str] | set[str] = frozenset(),
) -> TrainingReport:
    """Train for `config.schedule.steps` steps, filling `report` as it goes (it stays valid on failure).
    Once `stop` is set, no new step starts; the step in flight gets `stop_timeout_s` to finish (none
    once `alone` is set: the process that started this one died), and the report says `stopped_early`.
    `given`: the options the user set (the others may come from the run's spec)."""
    stop = stop or asyncio.Event()
    metrics = metrics or TrainerMetrics()
    reporting = config.reporting
    # A bar only where our lines go straight to a terminal; a caller's own `say` gets plain lines.
    progress = TrainingProgress(
        config.schedule.steps, log_every=reporting.log_every, say=say, interactive=say is print and sys.stdout.isatty()
    )
    say = progress.say
    data = open_data(config.corpus.data, tokenizer=model_tokenizer(config.model_dir) or "bytes", say=say)
    # The run's spec and this trainer's flags, settled once: the model (its vocabulary must be the
    # data's), the stages, the codec, the batch.
    settled = settle_trainer(config, given, find_spec(dht, config, given), data)
    config, model_config = settled.config, settled.model
    batches = config.schedule
    if settled.spec is not None:
        say(settled.spec.describe())
        if "model" not in given:
            protect_models(dht, config.network, [config.model], num_stages=config.num_stages, client_mode=True)
    if report.model not in ("", config.model):
        raise ResumeError(f"{reporting.report!r} is a report of {report.model}, not {config.model}")
    report.model = config.model
    sampler = MicrobatchSampler(
        data.train,
        seq_len=model_config.seq_len,
        batch_size=batches.batch_size,
        microbatch_size=batches.microbatch_size,
        seed=config.corpus.seed,
        what="the training split",
        shard=config.corpus.shard,
    )
    evaluation = config.evaluation
    validation = None
    if evaluation.eval_every:
        validation = ValidationBatches(
            data.val,
            seq_len=model_config.seq_len,
            batch_size=batches.batch_size,
            microbatch_size=batches.microbatch_size,
            count=evaluation.eval_batches,
        )
        if validation.warning:
            say(validation.warning)
    schedule = await _unless_stopped(
        stop,
        connect(
            dht,
            model=config.model,
            model_config=model_config,
            num_stages=config.num_stages,
            discovery=config.discovery,
            failover=config.failover,
            compression=config.compression,
            verification=config.verification,
            seed=config.corpus.seed,
            max_in_flight=batches.max_in_flight,
            routing=batches.routing,
            hub_timing_fraction=batches.hub_timing_fraction,
            clip_grad_norm=batches.clip_grad_norm,
            outer_commits=batches.outer_commits,
            data_source=f"data {data.folder}",
            metrics=metrics,
            say=say,
            access=run_access(config.authority, dht, say, roles=("trainer",), run=settled.run),
            data_plane=config.transport.data_plane,
        ),
    )
    if schedule is None:
        progress.close()
        report.stopped_early = True
        return report
    following = None
    if settled.spec is not None:  # each commit names the version of the run's spec its step follows
        schedule.client.spec_version = settled.spec.version

        def new_version(spec) -> None:
            schedule.client.spec_version = spec.version
            say(f"run {spec.run_id} version {spec.version}: {spec.changes[-1].describe()}")

        following = asyncio.create_task(follow_versions(dht, settled, new_version, stop))
    schedule.grad_norms = list(report.grad_norms)  # a resumed run's norms go on
    view, caller, num_stages = schedule.view, schedule.caller, schedule.num_stages
    metrics.set_run(
        model=config.model, num_stages=num_stages, codec=config.compression.codec, target_steps=batches.steps
    )
    # every stage's peers stated theirs (in a run: the members' claims count)
    report.split_boundaries = await read_split(dht, config.model, num_stages, view.split_claimants())
    say(
        f"training {config.model} over {num_stages} stages with {view.live_replicas()} replicas; "
        f"{len(data.train):,} tokens of data (vocabulary {data.vocab_size:,}), "
        f"batch {batches.batch_size} x {model_config.seq_len} tokens"
    )
    for stage, summary in averaging_by_stage(dict(enumerate(view.records))).items():
        say(f"stage {stage}: averaging {summary}")
    report.num_stages = num_stages
    refresher = asyncio.create_task(view.refresh_forever(config.discovery.refresh_period_s))
    earlier_contributions = dict(report.contributions)  # a resumed run's, counted on top
    started = time.perf_counter()
    try:
        first_step = report.steps  # > 0 when resuming: continue from the same data position
        tokens_at_start = report.tokens
        shared = None
        if config.corpus.shard[1] > 1:  # one of several trainers: the run's steps are global
            shared = SharedProgress(
                dht,
                model=config.model,
                num_stages=num_stages,
                batch=batches.batch_size,
                peer_id=identity_of(dht).peer_id,
            )
            first_step = await shared.join(at_least=first_step)
            stream = sampler.stream(first_step)
            say(
                f"data shard {config.corpus.data_shard}: steps are global over every trainer of run {shared.run} "
                f"(each ends at {batches.batch_size} samples from all of them); starting at step {first_step}"
            )
        if first_step:
            say(f"resuming at step {first_step} of {batches.steps}")
        for step in range(first_step, batches.steps):
            if stop.is_set():
                break
            step_started = time.perf_counter()
            if shared is not None:
                shared.begin(step)
                work = schedule.run_shared_step(lambda: next(stream), shared)
            else:
                work = schedule.run_step(sampler.batch(step))
            result = await _step_unless_stopped(work, stop, batches.stop_timeout_s, say, alone)
            if result is None:
                break
            loss, samples = result if shared is not None else (result, batches.batch_size)
            step_s = time.perf_counter() - step_started
            step_tokens = samples * model_config.seq_len
            report.steps, report.tokens = step + 1, report.tokens + step_tokens
            if samples:
                report.losses.append(loss)
            else:
                loss = None  # the other trainers finished this step before we sent anything
            report.tokens_per_s_by_step.append(step_tokens / step_s)
            report.step_end_s.append(time.perf_counter() - started)
            if reporting.report:  # after every step, so a killed trainer can resume where it was
                _fill_report(report, schedule, time.perf_counter() - started, earlier_contributions)
                report.write(reporting.report)
            metrics.observe_step(step=step + 1, loss=loss, tokens=step_tokens, duration_s=step_s)
            metrics.set_contributions(caller.contributions.snapshot())
            elapsed = time.perf_counter() - started
            progress.update(
                StepProgress(
                    step=step + 1,
                    total_steps=batches.steps,
                    loss=loss,
                    tokens_per_s=(report.tokens - tokens_at_start) / elapsed,
                    live_replicas=view.live_replicas(),
                    calls_retried=caller.counters.calls_retried,
                    elapsed_s=elapsed,
                    eval_loss=report.final_eval_loss,
                )
            )
            if (
                validation is not None
                and not stop.is_set()
                and ((step + 1) % evaluation.eval_every == 0 or step + 1 == batches.steps)
            ):
                eval_loss = await schedule.evaluate(validation.batches())
                report.eval_losses.append([step + 1, eval_loss])
                report.final_eval_loss = eval_loss
                metrics.eval_loss.set(eval_loss)
                say(f"step {step + 1}: validation loss {eval_loss:.4f} ({evaluation.eval_batches} batches)")
                if reporting.report:
                    report.write(reporting.report)
        if report.steps > first_step:  # replicas with a one-step delay apply the last step's update
            await schedule.flush(f"{schedule.run_id}:{report.steps}:flush")
        report.stopped_early = stop.is_set() and report.steps < batches.steps
        report.completed = not report.stopped_early
        if report.stopped_early:
            say(f"stopped early after step {report.steps} of {batches.steps}")
    finally:
        progress.close()
        refresher.cancel()
        if following is not None:
            following.cancel()
        schedule.cancel_outer_commit()
        schedule.client.close()  # the peers' handlers of our kept streams end now, not when idle
        _fill_report(report, schedule, time.perf_counter() - started, earlier_contributions)
    return report


def run_access(
    config: RunAccessConfig, dht: hivemind.DHT, say, *, roles: tuple[str, ...] = ROLES, run: RunInfo | None = None
) -> RunAccess | None:
    """This process's run (--run, or `run`, known from its spec) and credential (--credential,
    checked against its peer id and `roles`), or None."""
    access = load_run_access(config, peer_id=dht.peer_id.to_base58(), roles=roles, run=run)
    if access is None:
        if "trainer" in roles:
            say(f"warning: {NO_RUN_WARNING}")
        return None
    if access.held is None:
        say(
            f"run {access.authority.run.run_id}: no --credential, so only what the run lets anyone do "
            f"(evaluation, in an open run); training needs a trainer credential"
        )
    else:
        say(f"run {access.authority.run.run_id}: {credential_summary(access.held)}")
    return access


async def _unless_stopped(stop: asyncio.Event, coro):
    """`coro`'s result, or None when `stop` is set first (then `coro` is cancelled)."""
    work, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    finally:
        stopped.cancel()


async def _step_unless_stopped(step, stop: asyncio.Event, timeout_s: float, say, alone: asyncio.Event | None = None):
    """The step's result (its loss, and with a global step its samples); when `stop` is set while it runs, it gets `timeout_s` more (no new step
    starts after it), then it is abandoned (None). Once `alone` is set (the process that started
    this one died, and the swarm with it) it is abandoned at once."""
    work = asyncio.ensure_future(step)
    alone = alone or asyncio.Event()
    if await _unless_stopped(stop, asyncio.shield(work)) is None and not work.done():
        if not alone.is_set():
            say(f"stopping: waiting up to {timeout_s:.0f} s for the microbatches in flight")
        cut_short = asyncio.ensure_future(alone.wait())
        try:
            await asyncio.wait({work, cut_short}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut_short.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            say(
                "stopping: abandoned the step in flight"
                if alone.is_set()
                else "stopping: the step in flight did not finish in time; abandoned it"
            )
            return None
    return work.result()


async def connect(
    dht: hivemind.DHT,
    *,
    model: str,
    model_config: GPTConfig,
    num_stages: int | None,
    discovery: DiscoverySettings,
    failover: FailoverSettings,
    compression: CompressionSettings,
    max_in_flight: int,
    data_source: str,
    routing: str = DEFAULT_ROUTING,
    hub_timing_fraction: float = 0.0,
    clip_grad_norm: float = 0.0,
    outer_commits: str = DEFAULT_OUTER_COMMITS,
    metrics: TrainerMetrics,
    say=print,
    access: RunAccess | None = None,
    verification: VerificationSettings | None = None,
    seed: int = 0,
    data_plane: bool = True,
) -> StepSchedule:
    """Find the swarm's stages and wire the pipeline to them (the view, the caller, the schedule);
    returns once every stage has an online replica. Refuses, in one line, a swarm that serves
    another vocabulary (`data_source` says where ours comes from) or another model."""
    timeout_s = discovery.discovery_timeout_s
    num_stages = num_stages or await discover_num_stages(dht, model, timeout_s, say)
    p2p = await dht.replicate_p2p()
    credential = access.credential.decode() if access is not None and access.credential else None
    client = StageClient(p2p, model=model, num_stages=num_stages, credential=credential, data_plane=data_plane)
    view = SwarmView(
        dht,
        model=model,
        num_stages=num_stages,
        say=say,
        metrics=metrics,
        model_hash=model_hash(model_config),
        authority=access.authority if access is not None else None,
    )
    codecs = CodecPolicy(
        compression.codec, topk_fraction=compression.topk_fraction, loss_budget=compression.codec_loss_budget
    )
    caller = StageCaller(
        view,
        client,
        d_model=boundary_width(model_config),  # what crosses between stages: d_model, or a subspace's rank
        seq_len=model_config.seq_len,
        failover=failover,
        codecs=codecs,
        verify_fraction=verification.verify_fraction if verification is not None else 0.0,
        seed=seed,
        say=say,
    )
    schedule = StepSchedule(
        caller,
        max_in_flight=max_in_flight,
        run_id=secrets.token_hex(4),
        routing=routing,
        send_tokens=model_config.subspace_rank > 0,
        clip_grad_norm=clip_grad_norm,
        outer_commits=outer_commits,
        hub_timing_fraction=hub_timing_fraction,
        seed=seed,
    )
    codecs.warm_up()
    metrics.count_bytes(client.bytes.snapshot)
    metrics.watch_phases(caller.phases.snapshot)
    metrics.count_transports(client.transport.stats.snapshot)
    await wait_for_every_stage(view, timeout_s, vocab_size=model_config.vocab_size, vocab_source=data_source)
    return schedule


def transport_totals(snapshot: dict) -> dict:
    """A TransportStats snapshot as the report keeps it: per transport, calls made and bytes each way."""
    totals = {}
    for transport in TRANSPORTS:
        calls = sum(n for (t, side, _), n in snapshot["calls"].items() if (t, side) == (transport, "made"))
        sent, received = (snapshot["bytes"].get((transport, d), 0) for d in ("sent", "received"))
        if calls or sent or received:
            totals[transport] = {"calls": calls, "sent_bytes": sent, "received_bytes": received}
    return totals


def _fill_report(
    report: TrainingReport, schedule: StepSchedule, train_time_s: float, earlier_contributions: dict | None = None
) -> None:
    counters = schedule.counters
    report.train_time_s = train_time_s
    report.codec = schedule.caller.codecs.mode
    report.bytes_by_codec = schedule.client.bytes.snapshot()
    report.transports = transport_totals(schedule.client.transport.stats.snapshot())
    total_bytes = sum(item["wire_bytes"] for direction in report.bytes_by_codec.values() for item in direction.values())
    report.wire_bytes_per_token = total_bytes / report.tokens if report.tokens else 0.0
    if report.losses:
        report.initial_loss = report.losses[0]
        tail = report.losses[-min(5, len(report.losses)) :]
        report.final_loss = sum(tail) / len(tail)
    timed_tokens = report.tokens - report.resumed_from_step * (report.tokens // max(report.steps, 1))
    report.tokens_per_s = timed_tokens / report.train_time_s if report.train_time_s > 0 else 0.0
    earlier_bans = dict(report.banned_peers)
    for counter in dataclasses.fields(CallCounters):  # this process's counts (a resumed run's start afresh)
        setattr(report, counter.name, copy.deepcopy(getattr(counters, counter.name)))
    report.microbatches_lost = counters.microbatches_sent - counters.microbatches_done
    report.grad_norms = [round(norm, 6) for norm in schedule.grad_norms]
    report.averaging_by_stage = averaging_by_stage(dict(enumerate(schedule.view.records)))
    # a resumed run keeps the bans its report recorded (the trainer's own bans start afresh)
    report.banned_peers = {**earlier_bans, **counters.banned_peers}
    report.foreign_peers_skipped = len(schedule.view.foreign_peers)
    report.contributions = schedule.caller.contributions.merge(earlier_contributions or {})
    report.disputes = [dataclasses.asdict(d) for d in schedule.caller.disputes_unresolved]


async def _train_until_signalled(config, dht, report, say, metrics, given) -> TrainingReport:
    stop, alone = stop_events_in_loop(
        what="finishing the step in flight, then writing the report",
        what_alone="abandoning the step in flight, then writing the report",
    )
    return await train(config, dht, report, say, metrics=metrics, stop=stop, alone=alone, given=given)


def run_trainer(config: TrainerConfig, say=print, given: frozenset[str] | set[str] = frozenset()) -> TrainingReport:
    """Join the DHT as a client, train, write the report (also after an error or Ctrl-C)."""
    # The trainer only encodes, decodes and checks tensors: one torch thread. More threads spin
    # against the peers' compute on shared cores (measured: int8 encode 4.6 ms with 1 thread,
    # 54 ms with 2 on the busy 2-core machine).
    torch.set_num_threads(1)
    metrics = TrainerMetrics()
    reporting = config.reporting
    endpoint = serve_metrics(
        metrics.registry, reporting.metrics_host, reporting.metrics_port
    )  # before the DHT: fails fast
    if endpoint:
        say(f"metrics on {endpoint.url}")
    report = TrainingReport(model="", num_stages=config.num_stages or 0)  # the model: once settled
    if reporting.resume:
        report = TrainingReport.load(reporting.report)
        report.resumed_from_step = report.steps
    if reporting.report and os.path.isdir(os.path.dirname(os.path.abspath(reporting.report))):
        report_path = os.path.abspath(reporting.report)  # a killed run's half-written report
        remove_stale_temporaries(os.path.dirname(report_path), f"{os.path.basename(report_path)}.tmp.*")
    dht = start_dht(config.network, client_mode=True, models=[config.model] if "model" in given else [])
    schedule = config.schedule
    say(
        f"trainer {dht.peer_id.to_base58()} starting: {schedule.steps} steps, data "
        f"{config.corpus.data or 'the default corpus'}, report {reporting.report or 'none'} "
        f"(--verbose prints the whole configuration)"
    )
    try:
        asyncio.run(with_p2p_client(dht, _train_until_signalled(config, dht, report, say, metrics, given)))
    finally:
        if reporting.report:  # first: what must outlive the trainer, before the DHT's stop (up to 3 s)
            report.write(reporting.report)
        dht.shutdown()
        if endpoint:
            endpoint.close()
    return report
