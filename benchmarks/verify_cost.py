"""What spot checks cost (issue #59): tokens/s of one loopback swarm with `--verify-fraction` 0 and F,
side by side in one invocation.

    .venv/bin/python benchmarks/verify_cost.py --out benchmarks/out/verify_cost.json

One `small` swarm of 2 stages x 3 replicas (sync averaging, one torch thread each) on loopback, and
trainers one after the other on it, alternating between the fractions (0, F, 0, F, ...; `--repeats`
pairs per routing) so that a drift of the machine's load lands on both; each trainer trains
`--warmup` untimed steps, then `--steps` timed ones (batch 32 in microbatches of 4). Per row:
tokens/s over the timed steps, the checks made and what they found. The verdict: the mean over the
repeats of F's tokens/s against 0's, and whether it is within `--goal` (12% by default).

What it does not show: a swarm whose peers each have their own accelerator. Here six peers share
two cores, so every recompute takes compute from the training calls (a check recomputes about F of
the training compute, by construction); where replicas wait on each other (a GPU swarm's utilisation
is 0.24 to 0.4), recomputes use time otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from swarm.local_swarm import LocalSwarm  # noqa: E402


def train(swarm: LocalSwarm, args, workdir: str, name: str, fraction: float, routing: str) -> dict:
    report_path = os.path.join(workdir, f"{name}.json")
    trainer = swarm.start_trainer(
        *("--steps", str(args.warmup + args.steps), "--batch-size", "32", "--microbatch-size", "4"),
        *("--max-in-flight", "8", "--num-stages", "2", "--seed", "5", "--report", report_path),
        *("--verify-fraction", str(fraction), "--routing", routing),
        name=f"trainer-{name}",
    )
    code = trainer.popen.wait(timeout=args.timeout_s)
    with open(report_path) as f:
        report = json.load(f)
    timed = report["tokens_per_s_by_step"][args.warmup :]
    tokens = 32 * get_model_config(args.model).seq_len
    seconds = sum(tokens / rate for rate in timed)
    return {
        "run": name,
        "routing": routing,
        "verify_fraction": fraction,
        "finished": code == 0 and report.get("completed", False),
        "tokens_per_s": len(timed) * tokens / seconds if seconds else None,
        "median_step_tokens_per_s": statistics.median(timed) if timed else None,
        "calls_verified": report["calls_verified"],
        "calls_verified_by_call": report["calls_verified_by_call"],
        "verify_calls": report["verify_calls"],
        "verify_mismatches": report["verify_mismatches"],
        "verify_largest_agreeing_share": report["verify_largest_agreeing_share"],
        "banned_peers": report["banned_peers"],
        "microbatches_lost": report["microbatches_lost"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--replicas", type=int, default=3, help="replicas per stage (2 stages)")
    parser.add_argument("--fraction", type=float, default=0.1, help="the --verify-fraction measured against 0")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of trainers (0, then F) per routing")
    parser.add_argument("--routing", nargs="+", default=["direct", "hub"], choices=("direct", "hub"))
    parser.add_argument("--goal", type=float, default=0.12, help="the largest loss of tokens/s that passes")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per trainer")
    parser.add_argument("--out", default="benchmarks/out/verify_cost.json")
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-verify-cost-") as workdir:
        peer_args = ["--target-batch-size", "32", "--num-threads", "1"]
        with LocalSwarm(model=args.model, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
            swarm.start_bootstrap()
            peers = [swarm.start_peer(stage) for stage in range(2) for _ in range(args.replicas)]
            swarm.wait_online(peers, timeout_s=600)
            for routing in args.routing:
                for repeat in range(args.repeats):
                    for fraction in (0.0, args.fraction):
                        name = f"{routing}-{fraction}-{repeat}"
                        rows.append(train(swarm, args, workdir, name, fraction, routing))
                        print(json.dumps(rows[-1]), flush=True)
    verdicts = {}
    for routing in args.routing:
        base = [r["tokens_per_s"] for r in rows if r["routing"] == routing and r["verify_fraction"] == 0.0]
        checked = [r["tokens_per_s"] for r in rows if r["routing"] == routing and r["verify_fraction"] > 0.0]
        if None in base or None in checked:
            verdicts[routing] = {"meets_goal": False}
            continue
        ratio = statistics.fmean(checked) / statistics.fmean(base)
        verdicts[routing] = {
            "tokens_per_s_without": statistics.fmean(base),
            "tokens_per_s_with": statistics.fmean(checked),
            "ratio": round(ratio, 4),
            "meets_goal": ratio >= 1.0 - args.goal and all(r["finished"] and not r["banned_peers"] for r in rows),
        }
        print(f"{routing}: --verify-fraction {args.fraction} runs at {ratio:.3f} of 0's tokens/s", flush=True)
    write_report(
        args.out,
        {
            "command": " ".join(sys.argv),
            "model": args.model,
            "layout": f"2 stages x {args.replicas} replicas",
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "wall_s": round(time.monotonic() - started, 1),
            "rows": rows,
            "verdicts": verdicts,
        },
    )
    return 0 if all(v["meets_goal"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
