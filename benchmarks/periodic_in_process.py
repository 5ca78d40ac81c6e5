"""Issue #4, the `periodic` gap without the network: is "two replicas, each an AdamW step on its
half of the batch, parameters averaged after every step" worse than one AdamW step on the whole
batch, as an algorithm? Everything runs in this process on the same batches as
`benchmarks/replicas.py` (the `small` model, Shakespeare bytes, batch 16 in microbatches of 4,
AdamW lr 1e-3, weight decay 0.01, the peers' defaults):

* `one`: one model, one step per batch (what one replica per stage computes);
* `params`: two copies, copy r steps on microbatches r, r+2, ... of each batch, then their
  parameters are averaged (what `--averaging periodic` does at one round per step);
* `params+adam`: the same, also averaging AdamW's two moment buffers;
* `params/K` (K = 2, 4, ...; `--every`): parameters averaged after every K-th step only (a swarm
  whose rounds come every T seconds averages less often than every step when steps are short).

    .venv/bin/python benchmarks/periodic_in_process.py --steps 40 --out benchmarks/out/periodic_in_process.json

Prints and writes the loss of every step (the mean over the copies, before the step) and the
final loss (mean of the last 5 steps). No timing is measured.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import build_full_model  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, load_corpus  # noqa: E402

VARIANTS = ("one", "params", "params+adam")


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def step_on(model, optimizer, microbatches) -> float:
    """One optimizer step on the sample-weighted mean loss of `microbatches`; returns that loss."""
    optimizer.zero_grad()
    samples, total = sum(mb.size for mb in microbatches), 0.0
    for mb in microbatches:
        loss = model(mb.inputs, mb.targets)
        (loss * mb.size / samples).backward()
        total += loss.item() * mb.size / samples
    optimizer.step()
    return total


@torch.no_grad()
def average_in_place(tensors: list[torch.Tensor]) -> None:
    mean = sum(tensors) / len(tensors)
    for t in tensors:
        t.copy_(mean)


def train(variant: str, sampler: MicrobatchSampler, model_name: str, steps: int, lr: float) -> list[float]:
    every = int(variant.split("/")[1]) if "/" in variant else 1
    base = build_full_model(get_model_config(model_name), seed=0)
    if variant == "one":
        optimizer = adamw(base, lr)
        return [step_on(base, optimizer, sampler.batch(step)) for step in range(steps)]
    copies = [base, copy.deepcopy(base)]
    optimizers = [adamw(m, lr) for m in copies]
    losses = []
    for step in range(steps):
        microbatches = sampler.batch(step)
        losses.append(sum(step_on(m, o, microbatches[r::2]) for r, (m, o) in enumerate(zip(copies, optimizers))) / 2)
        if (step + 1) % every:
            continue
        for params in zip(*(m.parameters() for m in copies)):
            average_in_place(list(params))
            if variant == "params+adam":
                states = [o.state[p] for o, p in zip(optimizers, params)]
                for buffer in ("exp_avg", "exp_avg_sq"):
                    average_in_place([s[buffer] for s in states])
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument(
        "--every",
        type=int,
        nargs="*",
        default=[],
        metavar="K",
        help="also run `params` averaging only every K-th step, for each K given",
    )
    parser.add_argument("--out", default="benchmarks/out/periodic_in_process.json")
    args = parser.parse_args()
    variants = args.variants.split(",") + [f"params/{k}" for k in args.every]
    if unknown := set(variants) - set(VARIANTS) - {f"params/{k}" for k in args.every}:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = get_model_config(args.model)
    sampler = MicrobatchSampler(
        load_corpus(), seq_len=config.seq_len, batch_size=args.batch_size, microbatch_size=args.microbatch_size, seed=0
    )
    results = {}
    for variant in variants:
        losses = train(variant, sampler, args.model, args.steps, args.lr)
        final = sum(losses[-5:]) / len(losses[-5:])
        results[variant] = {"losses": losses, "final_loss": final}
        print(
            f"{variant:12s} final loss {final:.4f}   by step: " + " ".join(f"{x:.3f}" for x in losses[::4]), flush=True
        )
    if "one" in results:
        for variant, result in results.items():
            if variant != "one":
                gap = result["final_loss"] / results["one"]["final_loss"] - 1
                result["vs_one"] = gap
                print(f"{variant}: {gap:+.1%} against one", flush=True)
    write_report(args.out, {"args": vars(args), "results": results}, indent=1)


if __name__ == "__main__":
    main()
