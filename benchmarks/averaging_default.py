"""What the default `--averaging sync` costs in the demo's throughput against `--averaging none`
(issue 21): `swarm demo` (4 peers over 2 stages, 2 replicas per stage) run with each mode in turn,
`--repeats` times, alternating so that a change in the machine's load hits both.

    .venv/bin/python benchmarks/averaging_default.py --steps 15 --repeats 2 --out benchmarks/out/averaging_default.json

Per run: the trainer's tokens/s (its report: tokens over the whole run's wall time, start-up of the
trainer included) and the final loss. The figure is the demo's, on this machine: with every process
on loopback, the all-reduce costs CPU and a round trip, not bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402


def run_demo(mode: str, args: argparse.Namespace, workdir: str) -> dict:
    report = os.path.join(workdir, f"{mode}.json")
    command = [
        sys.executable, "-m", "swarm.cli", "demo", "--model", args.model, "--steps", str(args.steps),
        "--peers", "4", "--stages", "2", "--batch-size", str(args.batch_size), "--averaging", mode,
        "--report", report, "--workdir", os.path.join(workdir, mode),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    with open(report) as f:
        data = json.load(f)
    return {"mode": mode, "tokens_per_s": data["tokens_per_s"], "final_loss": data["final_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/averaging_default.json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="averaging-default-") as workdir:
        for repeat in range(args.repeats):
            for mode in ("none", "sync"):
                run = {"repeat": repeat, **run_demo(mode, args, os.path.join(workdir, str(repeat)))}
                print(json.dumps(run), flush=True)
                runs.append(run)
    summary = {
        mode: sum(r["tokens_per_s"] for r in runs if r["mode"] == mode) / args.repeats for mode in ("none", "sync")
    }
    write_report(
        args.out,
        {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(), "runs": runs, "mean": summary},
    )
    print(f"mean tokens/s: none {summary['none']:,.0f}, sync {summary['sync']:,.0f}")


if __name__ == "__main__":
    main()
