"""The baseline a user would pick instead of swarm: the same model as a fixed GPipe pipeline over
`torch.distributed` (gloo), one process per stage, using PyTorch's own `ScheduleGPipe`.

Stage i runs on rank i and sends its activations straight to rank i+1 (and gradients back), in
float32, with no compression and no replicas: if a rank dies, the others fail. The stages hold the
same weights as swarm's peers (`models.stages.build_stage`, same seed), train on the same
microbatches (`MicrobatchSampler`, same seed) with the same optimizer settings, so the loss curves
are comparable.

One rank (what `launch` starts once per stage, e.g. inside a network namespace):

    python -m benchmarks.gpipe_baseline --rank 0 --world-size 4 --master 10.213.0.3:29500 \\
        --model small --steps 20 --report out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.config import get_model_config  # noqa: E402
from models.gpt import language_model_loss  # noqa: E402
from models.stages import StageModule, build_stage  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, open_data  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LogitsStage(nn.Module):
    """A stage as `ScheduleGPipe` wants it: the last stage returns logits and the schedule's
    `loss_fn` computes the loss (StageModule computes it itself when given targets)."""

    def __init__(self, stage: StageModule):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stage
        x = s.embedding(x) if s.embedding is not None else x  # (B, T, C)
        for block in s.blocks:
            x = block(x)
        return s.head(x) if s.head is not None else x  # (B, T, V) on the last stage, else (B, T, C)


@dataclass
class BaselineReport:
    rank: int
    world_size: int
    model: str
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    completed: bool = False
    error: str | None = None

    def write(self, path: str) -> None:
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)


def run_rank(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.num_threads)
    config = get_model_config(args.model)
    master_host, master_port = args.master.rsplit(":", 1)
    report = BaselineReport(rank=args.rank, world_size=args.world_size, model=args.model)
    try:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://{master_host}:{master_port}",
            rank=args.rank,
            world_size=args.world_size,
            timeout=datetime.timedelta(seconds=args.timeout_s),
        )
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        module = LogitsStage(build_stage(config, args.rank, args.world_size, seed=args.seed))
        microbatches = args.batch_size // args.microbatch_size
        example = (
            torch.zeros(args.microbatch_size, config.seq_len, dtype=torch.int64)
            if args.rank == 0
            else torch.zeros(args.microbatch_size, config.seq_len, config.d_model)
        )
        stage = PipelineStage(module, args.rank, args.world_size, torch.device("cpu"), input_args=(example,))
        schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=language_model_loss)
        optimizer = OptimizerSettings(target_batch_size=args.batch_size).build(module.parameters())
        sampler = MicrobatchSampler(  # the training split, as the swarm's trainer draws from
            open_data(args.data, say=lambda line: None).train,
            seq_len=config.seq_len,
            batch_size=args.batch_size,
            microbatch_size=args.microbatch_size,
            seed=args.seed,
        )
        is_first, is_last = args.rank == 0, args.rank == args.world_size - 1
        for step in range(args.steps):
            started = time.perf_counter()
            batch = sampler.batch(step)
            inputs = torch.cat([mb.inputs for mb in batch])  # (B, T)
            targets = torch.cat([mb.targets for mb in batch])  # (B, T)
            losses: list[torch.Tensor] = []
            if is_first:
                schedule.step(inputs)
            elif is_last:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            report.step_seconds.append(time.perf_counter() - started)
            report.steps, report.tokens = step + 1, (step + 1) * args.batch_size * config.seq_len
            loss_text = ""
            if is_last:
                loss = float(torch.stack(losses).detach().mean())
                report.losses.append(loss)
                loss_text = f"  loss {loss:.4f}"
            print(
                f"step {step + 1:>4}/{args.steps}{loss_text}  "
                f"{args.batch_size * config.seq_len / report.step_seconds[-1]:,.0f} tok/s",
                flush=True,
            )
        report.completed = True
        return 0
    except Exception as e:  # a dead rank surfaces as assorted gloo/runtime errors: record and fail
        report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"rank {args.rank} failed at step {report.steps + 1}: {report.error}", file=sys.stderr, flush=True)
        return 1
    finally:
        if args.report:
            report.write(args.report)
        if torch.distributed.is_initialized() and report.completed:
            torch.distributed.destroy_process_group()


def rank_command(
    rank: int,
    world_size: int,
    master: str,
    *,
    model: str,
    steps: int,
    batch_size: int,
    microbatch_size: int,
    report: str,
    timeout_s: float = 60.0,
    seed: int = 0,
    python: str = sys.executable,
) -> list[str]:
    return [
        python,
        "-m",
        "benchmarks.gpipe_baseline",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--master",
        master,
        "--model",
        model,
        "--steps",
        str(steps),
        "--batch-size",
        str(batch_size),
        "--microbatch-size",
        str(microbatch_size),
        "--report",
        report,
        "--timeout-s",
        str(timeout_s),
        "--seed",
        str(seed),
    ]


def launch(
    commands: list[list[str]], log_paths: list[str], env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Start one process per rank, each in its own process group (stop with `os.killpg`)."""
    processes = []
    for command, log_path in zip(commands, log_paths):
        with open(log_path, "w") as log:
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,
                )
            )
    return processes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True, help="number of stages (one rank each)")
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous store")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="gloo timeout of every collective and p2p op")
    parser.add_argument("--report", default=None)
    args = parser.parse_args(argv)
    if args.batch_size % args.microbatch_size:
        parser.error("--batch-size must be a multiple of --microbatch-size")
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
