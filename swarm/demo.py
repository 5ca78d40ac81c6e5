"""`swarm demo`: a whole swarm on this machine (bootstrap node, peers over stages, a trainer on a
real corpus), trained for a few steps and stopped cleanly, also on Ctrl-C."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

from dht.authority import RunAccessConfig
from models.config import lora_rank
from models.model_source import resolve_model
from models.subspace_options import SubspaceSettings
from process.config import ConfigError, option, section
from process.fork_server import ForkServer
from process.lifetime import EXIT_SIGNALLED, ShutdownSignals, StopRequested
from swarm.export.config import ExportConfig
from swarm.export.run import run_export
from swarm.generate import GenerateConfig, generate_text
from swarm.local_swarm import LocalSwarm, start_fork_server
from swarm.trainer.data import model_for_data, model_tokenizer, open_data
from wire.compression.policy import CODEC_MODES


@dataclasses.dataclass(kw_only=True)
class DemoConfig:
    peers: int = option(4, help="peer processes to start (spread evenly over the stages)")
    stages: int = option(2, help="pipeline stages")
    steps: int = option(60, help="training steps")
    model: str = option("small", help="model to train")
    model_dir: str | None = option(None, help="a Hugging Face model folder (GPT-2 or Llama) to fine-tune instead")
    trainable: str = option("all", help="what is trained: all, or lora:R (rank-R LoRA adapters, base frozen)")
    batch_size: int = option(32, help="samples per step")
    microbatch_size: int = option(4, help="samples per microbatch")
    data: str | None = option(
        None,
        help="a folder made by `swarm data prepare`, or a text file (default: the Shakespeare corpus, "
        "prepared with --tokenizer into ~/.cache/swarm or $SWARM_CACHE_DIR the first time)",
    )
    tokenizer: str | None = option(
        None,
        help="tokenizer for a text file or the default corpus: bytes, bpe:VOCAB or a tokenizer.json "
        "(default: bpe:4096; with --model-dir, the folder's tokenizer.json, else bytes)",
    )
    warmup_steps: int | None = option(
        None, help="learning-rate warmup steps, then a cosine decay over the rest (default: a tenth of --steps)"
    )
    eval_every: int = option(10, help="validation loss through the swarm every N steps (0 = never)")
    eval_batches: int = option(4, help="validation batches per evaluation")
    codec: str = option(
        "none", help="compression on the wire (none, fp16, int8, int4, topk, adaptive)", choices=CODEC_MODES
    )
    report: str | None = option(None, help="write the trainer's JSON report here")
    workdir: str | None = option(None, help="folder for the processes' logs (default: a temporary one)")
    averaging: str = option(
        "sync",
        help="how the replicas of a stage agree (none: separate copies, for experiments)",
        choices=["sync", "periodic", "none"],
    )
    export: str | None = option(None, help="at the end, export the trained model to this folder and print a sample")
    clip_grad_norm: float = option(
        1.0, help="clip each step's gradient to this norm over every stage (0 = off; with --averaging sync)"
    )
    subspace: SubspaceSettings = section(SubspaceSettings, help="what crosses between stages: K coefficients per token")

    def __post_init__(self) -> None:
        self.model = self.subspace.apply(resolve_model(self.model, self.model_dir)).name
        try:
            lora_rank(self.trainable)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not 0.0 <= self.clip_grad_norm < float("inf"):
            raise ConfigError("--clip-grad-norm must be a finite number >= 0 (0 = off)")
        if self.stages < 1 or self.peers < self.stages:
            raise ConfigError(f"need at least one peer per stage: --peers {self.peers} --stages {self.stages}")
        if self.export is not None and os.path.exists(self.export):  # refused now, not after training
            raise ConfigError(f"--export {self.export!r} already exists; choose another folder")
        if self.data is not None and not os.path.exists(self.data):
            raise ConfigError(f"--data {self.data!r}: no such file or prepared data folder")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ConfigError("--eval-every must be at least 0 and --eval-batches at least 1")


def export_and_sample(config: DemoConfig, swarm: LocalSwarm, data_folder: str) -> None:
    """`swarm export` from the live peers (with the prepared data's tokenizer), then a short
    `swarm generate` from the folder."""
    export = ExportConfig(
        initial_peers=swarm.initial_peers,
        model=config.model,
        model_dir=config.model_dir,
        out=config.export,
        data=data_folder,
        overwrite=False,
        num_stages=config.stages,
        subspace=config.subspace,
        authority=RunAccessConfig(run=swarm.run_dir),  # the run's owner downloads the replicas' state
    )
    run_export(export)
    print("[demo] a sample from the exported model:", flush=True)
    generate_text(
        GenerateConfig(model_dir=config.export, prompt="ROMEO:" if config.data is None else "The", max_new_tokens=80)
    )
    print(f"[demo] more with: swarm generate --model-dir {config.export} --prompt TEXT", flush=True)


def run_demo(config: DemoConfig) -> int:
    """Start the swarm, train, stop it; the first SIGINT/SIGTERM stops every process in order (the
    trainer and peers first, the bootstrap node last), a second exits at once (the processes then
    stop themselves: they get SIGTERM when the demo dies)."""
    running = [True]

    def stop_now() -> None:
        if running[0]:
            running[0] = False
            raise StopRequested

    ShutdownSignals(stop_now, what="stopping the swarm", say=lambda line: print(f"[demo] {line}", flush=True)).install()
    try:
        code = _run_swarm(config)
    except StopRequested:  # the swarm was stopped on the way out of its `with`
        code = EXIT_SIGNALLED
    running[0] = False
    print("[demo] all processes stopped", flush=True)
    return code


def _run_swarm(config: DemoConfig) -> int:
    threads = max(1, (os.cpu_count() or 2) // config.peers)
    model_dir_args = ["--model-dir", os.path.abspath(config.model_dir)] if config.model_dir else []
    model_dir_args += ["--trainable", config.trainable, *config.subspace.args()]
    # The swarm's processes are forked by one process that imports the project once (about 2 s of
    # CPU each saved); it imports while the data is prepared.
    with start_fork_server() as fork_server:
        return _run_swarm_with(config, fork_server, threads, model_dir_args)


def _run_swarm_with(config: DemoConfig, fork_server: ForkServer, threads: int, model_dir_args: list[str]) -> int:
    # The data first: its vocabulary is the model's, so the peers start with it.
    data = open_data(
        config.data, tokenizer=demo_tokenizer(config), say=lambda line: print(f"[demo] {line}", flush=True)
    )
    vocab_args = [] if config.model_dir else ["--vocab-size", str(data.vocab_size)]
    # Data the model cannot read (a folder's model, or a user architecture's fixed vocabulary) is
    # refused here, in one line, before any process starts.
    model_for_data(config.model, config.model_dir, data)
    with LocalSwarm(
        model=config.model,
        num_stages=config.stages,
        workdir=config.workdir,
        peer_args=["--target-batch-size", str(config.batch_size), "--num-threads", str(threads)]
        + ["--averaging", config.averaging]
        + lr_schedule_args(config.steps, config.warmup_steps)
        + model_dir_args
        + vocab_args,
        launcher=fork_server.launch,
    ) as swarm:
        print(f"[demo] logs in {swarm.workdir}", flush=True)
        maddrs = swarm.start_bootstrap()
        print(f"[demo] bootstrap DHT node at {maddrs[0]}", flush=True)
        peers = [swarm.start_peer(i % config.stages) for i in range(config.peers)]
        swarm.wait_online(peers)
        print(f"[demo] {len(peers)} peers online over {config.stages} stages; starting the trainer", flush=True)
        report_path = config.report or os.path.join(swarm.workdir, "report.json")
        args = [
            "--steps",
            str(config.steps),
            "--batch-size",
            str(config.batch_size),
            "--microbatch-size",
            str(config.microbatch_size),
            "--report",
            report_path,
            "--num-stages",
            str(config.stages),
            "--codec",
            config.codec,
            "--stop-timeout-s",  # stopped, a local demo waits briefly for the step in flight, not 30 s
            "5",
        ]
        if config.averaging == "sync":  # only sync replicas clip (they step on the trainer's commit)
            args += ["--clip-grad-norm", str(config.clip_grad_norm)]
        args += [
            "--data",
            data.folder,
            "--eval-every",
            str(config.eval_every),
            "--eval-batches",
            str(config.eval_batches),
        ]
        args += model_dir_args
        trainer = swarm.start_trainer(*args)
        shown = 0
        while trainer.alive:  # relay the trainer's progress lines as they come
            try:
                trainer.popen.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            log = trainer.log()
            if len(log) > shown:
                print(log[shown:], end="", flush=True)
                shown = len(log)
        log = trainer.log()
        print(log[shown:], end="", flush=True)
        if trainer.popen.returncode != 0:
            reason = failure_reason(log)
            print(
                f"[demo] the trainer failed (exit {trainer.popen.returncode}){': ' + reason if reason else ''}; "
                f"logs in {swarm.workdir}",
                flush=True,
            )
            return 1
        with open(report_path) as f:
            report = json.load(f)
        print(
            f"[demo] loss {report['initial_loss']:.3f} -> {report['final_loss']:.3f} over {report['steps']} steps, "
            f"{report['tokens_per_s']:,.0f} tokens/s, {report['microbatches_sent']} microbatches sent, "
            f"{report['microbatches_retried']} retried, {report['microbatches_lost']} lost",
            flush=True,
        )
        if report.get("eval_losses"):
            first, last = report["eval_losses"][0], report["eval_losses"][-1]
            print(
                f"[demo] validation loss {first[1]:.3f} (step {first[0]}) -> {last[1]:.3f} (step {last[0]})",
                flush=True,
            )
        if config.export:
            export_and_sample(config, swarm, data.folder)
        print("[demo] stopping the swarm...", flush=True)
    return 0


def demo_tokenizer(config: DemoConfig) -> str:
    """--tokenizer, else the model folder's own tokenizer.json (bytes when it has none), else bpe:4096."""
    if config.tokenizer:
        return config.tokenizer
    if config.model_dir:
        return model_tokenizer(config.model_dir) or "bytes"
    return "bpe:4096"


def failure_reason(log: str) -> str | None:
    """The one-line error a `swarm` process printed before it exited (`swarm train: error: ...`)."""
    errors = [
        line.split(": error: ", 1)[1] for line in log.splitlines() if line.startswith("swarm ") and ": error: " in line
    ]
    return errors[-1].strip() if errors else None


def lr_schedule_args(steps: int, warmup_steps: int | None) -> list[str]:
    """The peers' learning-rate schedule for a run of `steps`: warmup, then cosine to a tenth of --lr."""
    warmup = max(steps // 10, 1) if warmup_steps is None else warmup_steps
    return ["--warmup-steps", str(warmup), "--lr-decay", "cosine", "--lr-decay-steps", str(max(steps - warmup, 1))]
