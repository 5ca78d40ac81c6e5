"""What one replica poisoning its stage's all-reduce does to training, with robust averaging on
(`--robust-averaging clip`, the default) and off (`none`), against a clean run (issue #25).

    .venv/bin/python benchmarks/robust_averaging.py --steps 20 --out benchmarks/out/robust_averaging.json

One run: a 2-stage `tiny` swarm on loopback in sync mode, three replicas of stage 0 (in the poisoned
runs one of them started with `--faults averaging=scale|flip`: its gradients x10 or negated in the
all-reduce) and one of stage 1; the trainer takes `--steps` steps and measures the validation loss
through the swarm at the end (the same validation batches in every run). Every peer of a run uses the
same `--robust-averaging`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.local_swarm import LocalSwarm, fault_args  # noqa: E402

CASES = [("none", "clip"), ("scale", "none"), ("scale", "clip"), ("flip", "none"), ("flip", "clip")]


def one_run(lie: str, robust: str, args: argparse.Namespace, workdir: str) -> dict:
    report_path = os.path.join(workdir, "report.json")
    peer_args = ["--averaging", "sync", "--lr", str(args.lr), "--robust-averaging", robust]
    started = time.monotonic()
    with LocalSwarm(workdir=workdir, model="tiny", num_stages=2, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(0), swarm.start_peer(0), swarm.start_peer(1)]
        lying = fault_args(averaging=lie) if lie != "none" else []
        peers.append(swarm.start_peer(0, "--no-load-state", *lying))
        swarm.wait_online(peers)
        trainer = swarm.start_trainer(
            *("--steps", str(args.steps), "--batch-size", str(args.batch_size), "--microbatch-size", "2"),
            *("--num-stages", "2", "--eval-every", str(args.steps), "--eval-batches", "4"),
            *("--report", report_path),
        )
        if trainer.popen.wait(timeout=1800) != 0:
            raise RuntimeError(f"the trainer failed:\n{trainer.log()[-3000:]}")
        clipped = sum(p.log().count("Robust averaging (clip) clipped") for p in peers[:2])
    report = json.loads(open(report_path).read())
    return {
        "lie": lie,
        "robust": robust,
        "val_loss": round(report["final_eval_loss"], 4),
        "final_train_loss": round(report["final_loss"], 4),
        "rounds_with_a_clip_at_honest_replicas": clipped,
        "microbatches_lost": report["microbatches_lost"],
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="benchmarks/out/robust_averaging.json")
    args = parser.parse_args()
    runs = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="robust-averaging-") as workdir:
        for lie, robust in CASES:
            run = one_run(lie, robust, args, os.path.join(workdir, f"{lie}-{robust}"))
            print(json.dumps(run), flush=True)
            runs.append(run)
    clean = runs[0]["val_loss"]
    for run in runs:
        run["val_loss_vs_clean"] = round(run["val_loss"] / clean - 1, 4)
    write_report(
        args.out,
        {
            "args": vars(args),
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "runs": runs,
        },
    )
    for run in runs:
        print(
            f"lie {run['lie']:5} robust {run['robust']:4}: val loss {run['val_loss']} ({run['val_loss_vs_clean']:+.1%})"
        )


if __name__ == "__main__":
    main()
