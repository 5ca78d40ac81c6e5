"""How far an honest half-precision answer lies from the float32 recompute that checks it (issue #59).

A spot check asks a second replica to recompute the call in float32 (`RequestHeader.check_precision`)
and holds the first answer to the bound of the precision its replica announced
(swarm/trainer/spot_checks.py `PRECISION_ERRORS`). This measures that honest difference, on the
stages that are served: a 2-stage split of `--models` trained on the default corpus (Shakespeare,
bytes) with AdamW, and at each of `--checkpoints` (optimizer steps), over `--calls` microbatches
not trained on, the relative L2 difference between the stage's answer in bf16/fp16 autocast and in
float32, per component a check compares: stage 0's forward outputs, the last stage's loss, input
gradient and parameter-gradient sample (peers/compute/grad_sample.py), and stage 0's backward
sample. Both answers come from `StageRuntime.recompute`, the code a checker runs.

It also measures two replicas that cannot be checked alike: `--weight-prediction local-step`
replicas, each computing on its parameters plus the update its own gradients make (the same
parameters, the step's microbatches split between two replicas): their answers' difference.

Per component and precision: mean, standard deviation and largest difference, the bound in force,
how many standard deviations above the mean it sits (z) and the normal tail beyond it: the
probability that one honest check is over the bound (a ban needs two checkers to agree against it:
the bound's tail is the ban's probability per check). What it does not show: other hardware (a GPU's
bf16 kernels round elsewhere; no GPU was lent), other models, a normal tail is a model of the
distribution, not a measurement beyond the calls measured.

    .venv/bin/python benchmarks/precision_bounds.py --out benchmarks/out/precision_bounds.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime  # noqa: E402
from swarm.trainer.data import load_corpus  # noqa: E402
from swarm.trainer.spot_checks import PRECISION_ERRORS, TIGHT, relative_difference  # noqa: E402

COMPONENTS = ("stage0_outputs", "last_loss", "last_grad_inputs", "last_grad_sample", "stage0_grad_sample")


def windows(corpus: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator):
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=generator)
    inputs = torch.stack([corpus[s : s + seq_len] for s in starts]).long()
    targets = torch.stack([corpus[s + 1 : s + seq_len + 1] for s in starts]).long()
    return inputs, targets


def answers(stages: list[StageRuntime], inputs, targets, precision: str) -> dict[str, torch.Tensor]:
    """Every component a check compares, as a recompute in `precision` gives it (stage 0's backward
    is fed the float32 input gradient of the last stage, as a checker is fed what crossed)."""
    first, last = stages
    outputs, _, _ = first.recompute("forward", inputs, precision="fp32")
    low_outputs, _, _ = first.recompute("forward", inputs, precision=precision)
    grad_inputs, loss, sample = last.recompute("backward", outputs, targets=targets, precision=precision)
    reference_grad, _, _ = last.recompute("backward", outputs, targets=targets, precision="fp32")
    _, _, first_sample = first.recompute("backward", inputs, grad_outputs=reference_grad, precision=precision)
    return {
        "stage0_outputs": low_outputs,
        "last_loss": torch.tensor(loss),
        "last_grad_inputs": grad_inputs,
        "last_grad_sample": torch.tensor(sample),
        "stage0_grad_sample": torch.tensor(first_sample),
    }


def train_step(stages: list[StageRuntime], corpus, batch: int, microbatches: int, generator) -> None:
    first, last = stages
    for m in range(microbatches):
        inputs, targets = windows(corpus, batch, first.config.seq_len, generator)
        outputs = first.forward(f"train:{m}", inputs)
        grad, _ = last.backward(f"train:{m}", outputs, targets=targets)
        first.backward(f"train:{m}", None, grad_outputs=grad, batch_size=batch)
    for stage in stages:
        stage.step()


def twin_of(stage: StageRuntime) -> StageRuntime:
    """A second replica of `stage`: the same parameters, optimizer state and steps (a runtime holds
    locks, so it is built again, not deep-copied)."""
    twin = StageRuntime(stage.config, stage.stage, stage.num_stages, seed=stage.seed, optimizer=stage.settings)
    twin.module.load_state_dict(stage.module.state_dict())
    twin.optimizer.load_state_dict(stage.optimizer.state_dict())
    twin.steps_done = stage.steps_done
    return twin


def local_step_pair(stages: list[StageRuntime], corpus, batch: int, microbatches: int, generator, calls: int):
    """Two local-step replicas of each stage: the same parameters and optimizer state, each with the
    mean gradient of its half of a step's microbatches as its prediction; their answers' differences."""
    pairs = []
    for stage in stages:
        twin = twin_of(stage)
        twin.weight_prediction = stage.weight_prediction = "local-step"
        pairs.append((stage, twin))
    first_pair, last_pair = pairs
    for replica in (0, 1):  # each replica's half of a step: its local gradients
        for m in range(microbatches // 2):
            inputs, targets = windows(corpus, batch, first_pair[0].config.seq_len, generator)
            a, b = first_pair[replica], last_pair[replica]
            outputs = a.forward(f"local:{replica}:{m}", inputs)
            grad, _ = b.backward(f"local:{replica}:{m}", outputs, targets=targets)
            a.backward(f"local:{replica}:{m}", None, grad_outputs=grad, batch_size=batch)
    for pair in pairs:
        for replica in pair:
            replica.predict_local_step(replica.local_mean_gradients())
    differences = {"stage0_outputs": [], "last_grad_inputs": [], "last_grad_sample": []}
    for _ in range(calls):
        inputs, targets = windows(corpus, batch, first_pair[0].config.seq_len, generator)
        outs = [r.recompute("forward", inputs)[0] for r in first_pair]
        differences["stage0_outputs"].append(relative_difference(*outs))
        backs = [r.recompute("backward", outs[0], targets=targets) for r in last_pair]
        differences["last_grad_inputs"].append(relative_difference(backs[0][0], backs[1][0]))
        differences["last_grad_sample"].append(
            relative_difference(torch.tensor(backs[0][2]), torch.tensor(backs[1][2]))
        )
    for stage in stages:
        stage.weight_prediction, stage.predicted_update = "none", None
    return {name: summary(values, None) for name, values in differences.items()}


def summary(values: list[float], bound: float | None) -> dict:
    mean, sd = statistics.fmean(values), statistics.pstdev(values)
    out = {"calls": len(values), "mean": mean, "sd": sd, "max": max(values)}
    if bound is not None:
        z = (bound - mean) / sd if sd > 0 else math.inf
        out.update(
            bound=bound,
            over_bound=sum(v > bound for v in values),
            z=z,
            normal_tail=0.5 * math.erfc(z / math.sqrt(2)) if math.isfinite(z) else 0.0,
            max_share_of_bound=max(values) / bound,
        )
    return out


def measure(model: str, args, corpus) -> dict:
    config = get_model_config(model)
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = OptimizerSettings(lr=args.lr, target_batch_size=10**9)
    stages = [StageRuntime(config, s, 2, seed=args.seed, optimizer=optimizer) for s in range(2)]
    for stage in stages:
        stage.auto_step = False
    rows, done = [], 0
    for checkpoint in args.checkpoints:
        while done < checkpoint:
            train_step(stages, corpus, args.batch, args.microbatches, generator)
            done += 1
        row = {"model": model, "steps": done, "precisions": {}}
        for precision in args.precisions:
            reference = {name: [] for name in COMPONENTS}
            for _ in range(args.calls):
                inputs, targets = windows(corpus, args.batch, config.seq_len, generator)
                exact, low = answers(stages, inputs, targets, "fp32"), answers(stages, inputs, targets, precision)
                for name in COMPONENTS:
                    reference[name].append(relative_difference(exact[name], low[name]))
            bound = TIGHT + PRECISION_ERRORS[precision]  # a checked answer against a float32 recompute
            row["precisions"][precision] = {name: summary(values, bound) for name, values in reference.items()}
        row["local_step"] = local_step_pair(stages, corpus, args.batch, args.microbatches, generator, args.calls)
        rows.append(row)
        print(json_line(row), flush=True)
    return rows


def json_line(row: dict) -> str:
    parts = [f"{row['model']} step {row['steps']}:"]
    for precision, components in row["precisions"].items():
        worst = max(components.items(), key=lambda item: item[1]["max"])
        parts.append(f"{precision} worst {worst[0]} max {worst[1]['max']:.2e} (z {worst[1]['z']:.1f})")
    local = max(row["local_step"].values(), key=lambda s: s["max"])
    parts.append(f"local-step max {local['max']:.2e}")
    return " ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[0, 20])
    parser.add_argument("--calls", type=int, default=40, help="microbatches measured at each checkpoint")
    parser.add_argument("--batch", type=int, default=2, help="samples per microbatch")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per training step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/out/precision_bounds.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before, started = os.getloadavg(), time.monotonic()
    corpus = load_corpus()
    rows = [row for model in args.models for row in measure(model, args, corpus)]
    write_report(
        args.out,
        {
            "command": " ".join(sys.argv),
            "tight": TIGHT,
            "precision_errors": PRECISION_ERRORS,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "wall_s": round(time.monotonic() - started, 1),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
