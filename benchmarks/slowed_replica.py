"""The share of calls a replica slowed 3x receives next to its unslowed partner (issue #3's goal:
a third of its partner's share, within 20%). This ratio used to be asserted in a timed integration
test, which failed on a loaded machine; the test now checks behaviour (the slowed replica gets
clearly less, nothing is lost) and the ratio lives here.

    .venv/bin/python benchmarks/slowed_replica.py --runs 3 --routings direct hub --out benchmarks/out/slowed_replica.json

One run: a 2-stage `small` swarm on loopback, one stage-0 peer, two stage-1 peers of which one is
slowed 3x with `--faults slowdown_mode=busy` (it spends its extra time computing, so load on the
machine hits both replicas alike); a trainer does warm-up steps, then counted steps of 8
microbatches of one sample, under each routing given (the runs of each, one after another). The
ratio is the slowed replica's stage-1 calls over its partner's, counted after the warm-up from the
trainer's report (rewritten after every step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.local_swarm import LocalSwarm, fault_args  # noqa: E402

GOAL = (1 / 3 * 0.8, 1 / 3 * 1.2)


def _peer_key(process) -> str:
    match = re.search(r"peer (\S+) online", process.log())
    if not match:
        raise RuntimeError(f"{process.name} printed no peer id:\n{process.log()[-2000:]}")
    return match.group(1)[-8:]


def _report_at(path: str, step: int) -> dict | None:
    try:
        report = json.loads(open(path).read())
    except (OSError, ValueError):
        return None
    return report if report.get("steps", 0) >= step else None


def one_run(warmup_steps: int, counted_steps: int, workdir: str, routing: str) -> dict:
    report_path = os.path.join(workdir, "report.json")
    with LocalSwarm(workdir=workdir, model="small", num_stages=2, peer_args=["--target-batch-size", "8"]) as swarm:
        swarm.start_bootstrap()
        first = swarm.start_peer(0)
        fast = swarm.start_peer(1)
        slow = swarm.start_peer(1, *fault_args(slowdown=3, slowdown_mode="busy"))
        swarm.wait_online([first, fast, slow])
        trainer = swarm.start_trainer(
            *("--steps", str(warmup_steps + counted_steps), "--batch-size", "8", "--microbatch-size", "1"),
            *("--max-in-flight", "4", "--num-stages", "2", "--report", report_path, "--routing", routing),
        )
        deadline = time.monotonic() + 600
        while (after_warmup := _report_at(report_path, warmup_steps)) is None:
            if not trainer.alive or time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not reach step {warmup_steps}:\n{trainer.log()[-3000:]}")
            time.sleep(0.05)
        if trainer.popen.wait(timeout=900) != 0:
            raise RuntimeError(f"the trainer failed:\n{trainer.log()[-3000:]}")
        final = json.loads(open(report_path).read())
        calls = {p: n - after_warmup["calls_by_peer"].get(p, 0) for p, n in final["calls_by_peer"].items()}
        slow_calls, fast_calls = calls[_peer_key(slow)], calls[_peer_key(fast)]
    return {
        "routing": routing,
        "counted_steps": final["steps"] - after_warmup["steps"],
        "slowed_calls": slow_calls,
        "partner_calls": fast_calls,
        "ratio": slow_calls / fast_calls,
        "within_goal": GOAL[0] <= slow_calls / fast_calls <= GOAL[1],
        "microbatches_sent": final.get("microbatches_sent"),
        "microbatches_lost": final.get("microbatches_lost"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="independent swarms, one after another")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--counted-steps", type=int, default=20)
    parser.add_argument("--routings", nargs="+", choices=("direct", "hub"), default=["direct", "hub"])
    parser.add_argument("--out", default="benchmarks/out/slowed_replica.json")
    args = parser.parse_args()
    runs = []
    for routing in args.routings:
        for index in range(args.runs):
            load_before = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="slowed-replica-") as workdir:
                run = one_run(args.warmup_steps, args.counted_steps, workdir, routing)
            run["load_before"] = load_before
            runs.append(run)
            print(
                f"{routing} run {index + 1}: slowed {run['slowed_calls']} calls vs partner {run['partner_calls']}, "
                f"ratio {run['ratio']:.3f} (goal {GOAL[0]:.3f}-{GOAL[1]:.3f}); load {load_before:.1f}",
                flush=True,
            )
    write_report(args.out, {"goal": list(GOAL), "runs": runs, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
