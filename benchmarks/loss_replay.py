"""Per-step losses of rebalance_loopback's training replayed in one process, without a network: the
same model, data order (seed 0), batch 16 in microbatches of 2 and peer optimizer (AdamW, lr 1e-3,
a step every 16 samples per replica), with stage replicas as StageRuntimes. Shows whether a loss
spike comes from the swarm (a move, stale state, routing) or from the optimization itself.

    nice -n 10 .venv/bin/python benchmarks/loss_replay.py --layouts 1:1 2:2 3:1 3:1-move

Layouts: `S0:S1` replicas per stage, static; `3:1-move`: 3:1 until `--move-at-step`, then one
stage-0 replica leaves and a new stage-1 replica starts from a copy of stage 1's state (as a moved
peer does), taken `--stale-steps` steps before it starts serving. Microbatch i of a step goes to
replica i mod n of each stage; a stage-0 backward goes back to its forward's replica with
probability `--same-backward` (else to a random one, which recomputes the forward).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from peers.compute.checkpoint import deserialize_state  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, load_corpus  # noqa: E402


def replay(args, layout: str) -> list[float]:
    config = get_model_config(args.model)
    settings = OptimizerSettings(target_batch_size=args.batch_size)
    sampler = MicrobatchSampler(
        load_corpus(None),
        seq_len=config.seq_len,
        batch_size=args.batch_size,
        microbatch_size=args.microbatch_size,
        seed=0,
    )
    moving = layout.endswith("-move")
    n0, n1 = (int(n) for n in layout.removesuffix("-move").split(":"))
    stage0 = [StageRuntime(config, 0, 2, optimizer=settings) for _ in range(n0)]
    stage1 = [StageRuntime(config, 1, 2, optimizer=settings) for _ in range(n1)]
    rng, copy, losses = random.Random(1), None, []
    for step in range(args.steps):
        if moving and step == max(args.move_at_step - args.stale_steps, 0):
            copy = stage1[0].export_state(args.model)
        if moving and step == args.move_at_step:
            stage0.pop()
            moved = StageRuntime(config, 1, 2, optimizer=settings)
            moved.import_state(deserialize_state(copy, "the replica's state"), args.model, "the replica's state")
            stage1.append(moved)
        total, samples = 0.0, 0
        for i, mb in enumerate(sampler.batch(step)):
            microbatch_id = f"{step}:{i}"
            first = stage0[(step * 1000 + i) % len(stage0)]
            outputs = first.forward(microbatch_id, mb.inputs)
            grad, loss = stage1[(step * 1000 + i) % len(stage1)].backward(microbatch_id, outputs, targets=mb.targets)
            back = first if rng.random() < args.same_backward else rng.choice(stage0)
            back.backward(microbatch_id, mb.inputs, grad_outputs=grad)
            total, samples = total + loss * mb.size, samples + mb.size
        losses.append(round(total / samples, 3))
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--layouts", nargs="+", default=["1:1", "2:2", "3:1", "3:1-move"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--move-at-step", type=int, default=5)
    parser.add_argument("--stale-steps", type=int, default=0)
    parser.add_argument("--same-backward", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/out/loss_replay.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for layout in args.layouts:
        results[layout] = replay(args, layout)
        print(f"{layout:>10}: {' '.join(f'{loss:.2f}' for loss in results[layout])}", flush=True)
    write_report(args.out, {"benchmark": "loss_replay", "args": vars(args), "losses": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
