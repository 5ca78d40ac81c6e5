"""The optimizer alone: the demo's training (model `small`, the bundled Shakespeare corpus with a
BPE vocabulary of 4096, batch 32, AdamW at lr 1e-3) in one process, with a constant learning rate
(every peer before the schedule existed) against the demo's schedule (warmup for a tenth of the
steps, then cosine to a tenth of the rate). The same batches for both; per-step training loss, the
largest rise of it from one step to the next, and the validation loss at the end (equal tokens).

    nice -n 10 .venv/bin/python benchmarks/lr_schedule.py --steps 60 --out /tmp/lr_schedule.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import build_full_model  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings  # noqa: E402
from swarm.demo import lr_schedule_args  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, ValidationBatches, open_data  # noqa: E402


def schedule_settings(steps: int, scheduled: bool) -> OptimizerSettings:
    if not scheduled:
        return OptimizerSettings()
    args = lr_schedule_args(steps, None)
    flags = dict(zip(args[::2], args[1::2]))
    return OptimizerSettings(
        warmup_steps=int(flags["--warmup-steps"]),
        lr_decay=flags["--lr-decay"],
        lr_decay_steps=int(flags["--lr-decay-steps"]),
    )


def train(args, data, settings: OptimizerSettings) -> dict:
    config = dataclasses.replace(get_model_config(args.model), vocab_size=data.vocab_size)
    torch.manual_seed(0)
    model = build_full_model(config)
    optimizer = settings.build(model.parameters())
    schedule = settings.schedule()
    sampler = MicrobatchSampler(data.train, seq_len=config.seq_len, batch_size=args.batch_size, microbatch_size=4)
    losses, started = [], time.perf_counter()
    for step in range(args.steps):
        microbatches = sampler.batch(step)
        inputs = torch.cat([mb.inputs for mb in microbatches])
        targets = torch.cat([mb.targets for mb in microbatches])
        for group in optimizer.param_groups:
            group["lr"] = schedule.rate(step)
        optimizer.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    validation = ValidationBatches(data.val, seq_len=config.seq_len, batch_size=32, microbatch_size=4, count=4)
    with torch.no_grad():
        val = [
            model(torch.cat([mb.inputs for mb in batch]), torch.cat([mb.targets for mb in batch])).item()
            for batch in validation.batches()
        ]
    return {
        "schedule": dataclasses.asdict(schedule),
        "losses": [round(x, 4) for x in losses],
        "largest_rise": round(max(b - a for a, b in zip(losses, losses[1:])), 4),
        "final_loss": round(sum(losses[-5:]) / 5, 4),
        "val_loss": round(sum(val) / len(val), 4),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="lr_schedule.json")
    args = parser.parse_args()
    data = open_data(None, tokenizer="bpe:4096")
    report = {"args": vars(args), "load_before": os.getloadavg()}
    for name, scheduled in (("constant", False), ("demo_schedule", True)):
        report[name] = train(args, data, schedule_settings(args.steps, scheduled))
        print(name, {k: v for k, v in report[name].items() if k != "losses"}, flush=True)
    report["load_after"] = os.getloadavg()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
