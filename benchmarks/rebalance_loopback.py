"""Tokens/s of a loopback swarm that starts 3:1 (three peers on stage 0, one on stage 1) before and
after its peers rebalance themselves to 2:2, next to the same start with rebalancing off.

    flock /tmp/swarm-bench.lock timeout 900 nice -n 5 .venv/bin/python benchmarks/rebalance_loopback.py \
        --out benchmarks/out/rebalance_loopback.json

Making the bottleneck real on a small machine: every peer runs with `--faults slowdown=S` (default
60), so each compute takes S times as long, the extra time slept. The peers then behave like four
machines, each S times slower than a share of this CPU, instead of four processes fighting over
the same 2 cores (where adding a replica to a stage adds no compute at all). With
`--slowdown-mode device` (the default since the runs of issue #7's third round) a call lasts S x the
CPU time it used, so other processes' load on the shared machine is not multiplied by S; with
`sleep` (the earlier runs) the extra time is S - 1 times the call's wall time, contention included. The slowdown is the
same for every peer; the imbalance comes only from the 3:1 layout. With S = 10 the tiny model's
compute was still small next to RPC latency and the trainer's own CPU on a loaded 2-core machine:
the swarm was not stage-bound and rebalancing changed nothing (see benchmarks/RESULTS.md).

Two swarms, run one after the other, with the same trainer settings:
- `static`: rebalancing off; its tokens/s is what a 3:1 swarm gets for as long as it runs.
- `rebalancing`: `--rebalance-period-s P`; one trainer run through the move. Each step is labelled
  with the replicas the trainer saw (its progress line); "before" is the 3:1 steps after warm-up,
  "after" the 2:2 steps after `--settle-steps` more. The ratio after/before is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from swarm.local_swarm import LocalSwarm, fault_args  # noqa: E402

STEP_LINE = re.compile(r"step\s+(\d+)/\d+ .*replicas \[(\d+), (\d+)\]")
METRICS_URL = re.compile(r"metrics on (http://\S+)")
METRIC_LINE = re.compile(
    r"^(swarm_peer_(?:compute|queue|request)_duration_seconds_(?:sum|count)|swarm_peer_samples_total|"
    r"swarm_peer_activation_cache_\w+|process_cpu_seconds_total)(?:\{(.*)\})? (\S+)$"
)


def peer_time_use(process) -> dict:
    """Where a peer's time went, from its Prometheus endpoint: seconds computing, queued and serving
    per (stage, rpc), samples, activation cache hits/misses and CPU seconds. Empty if unreachable."""
    match = METRICS_URL.search(process.log())
    if not match:
        return {}
    try:
        with urllib.request.urlopen(match.group(1), timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    use: dict = {}
    for line in text.splitlines():
        if m := METRIC_LINE.match(line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            key = m.group(1) + "".join(f"/{labels[k]}" for k in ("stage", "rpc", "result") if k in labels)
            use[key] = round(float(m.group(3)), 3)
    return use


def run_swarm(args, *, rebalance: bool, stages: tuple[int, ...] = (0, 0, 0, 1)) -> dict:
    workdir = tempfile.mkdtemp(prefix="swarm-rebalance-bench-")
    report_path = os.path.join(workdir, "report.json")
    peer_args = [
        "--target-batch-size",
        str(args.batch_size),
        "--num-threads",
        "1",
        "--announce-period-s",
        "2",
        *fault_args(slowdown=args.slowdown, slowdown_mode=args.slowdown_mode),
    ]
    if rebalance:
        peer_args += ["--rebalance-period-s", str(args.rebalance_period_s), "--rebalance-min-gain", "0.2"]
    with LocalSwarm(model=args.model, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(stage) for stage in stages]
        swarm.wait_online(peers)
        started = time.monotonic()
        trainer = swarm.start_trainer(
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--microbatch-size",
            str(args.microbatch_size),
            "--max-in-flight",
            str(args.max_in_flight),
            "--num-stages",
            "2",
            "--refresh-period-s",
            "1",
            "--report",
            report_path,
        )
        if trainer.popen.wait(timeout=args.timeout_s) != 0:
            raise RuntimeError(f"trainer failed:\n{trainer.log()[-3000:]}")
        wall_s = time.monotonic() - started
        time_use = {p.name: peer_time_use(p) for p in peers}
        busy = {
            name: round(
                sum(v for k, v in use.items() if k.startswith("swarm_peer_compute_duration_seconds_sum")) / wall_s, 2
            )
            for name, use in time_use.items()
            if use
        }
        print(f"  compute thread busy (share of the trainer's wall time, slowdown included): {busy}", flush=True)
        moves = [line for p in peers for line in p.log().splitlines() if line.startswith("moved from stage")]
        # What each peer said about moves and state (the logs stay in `workdir` for a closer look).
        peer_events = {
            p.name: [
                line
                for line in p.log().splitlines()
                if line.startswith(("rebalancing:", "moved from", "loaded stage", "replica ", "no replica"))
            ]
            for p in peers
        }
        layouts = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in STEP_LINE.finditer(trainer.log())}
    with open(report_path) as f:
        report = json.load(f)
    tokens_per_step = args.batch_size * get_model_config(args.model).seq_len
    per_step = report["tokens_per_s_by_step"]

    def window(steps: list[int]) -> dict:
        seconds = sum(tokens_per_step / per_step[s - 1] for s in steps)
        return {"steps": len(steps), "tokens_per_s": len(steps) * tokens_per_step / seconds if steps else None}

    timed = [s for s in range(args.warmup + 1, len(per_step) + 1)]
    result = {
        "rebalancing": rebalance,
        "wall_s": wall_s,
        "moves": moves,
        "microbatches_lost": report["microbatches_lost"],
        "microbatches_retried": report["microbatches_retried"],
        "failures_by_kind": report["failures_by_kind"],
        "layout_by_step": [layouts.get(s) for s in range(1, len(per_step) + 1)],
        "all_timed": window(timed),
        "workdir": workdir,
        "peer_events": peer_events,
        "peer_time_use": time_use,
        "busy_share": busy,
        "losses": report["losses"],
        "step_s": [tokens_per_step / t for t in per_step],
        "step_end_s": report["step_end_s"],
        "calls_by_peer": report["calls_by_peer"],
        "backward_inputs_skipped": report.get("backward_inputs_skipped"),
        "backward_inputs_resent": report.get("backward_inputs_resent"),
    }
    if rebalance:
        before = [s for s in timed if layouts.get(s) == (3, 1)]
        first_balanced = next((s for s in range(1, len(per_step) + 1) if layouts.get(s) == (2, 2)), None)
        after = (
            [s for s in timed if s >= first_balanced + args.settle_steps and layouts.get(s) == (2, 2)]
            if first_balanced
            else []
        )
        result.update(before=window(before), after=window(after), first_balanced_step=first_balanced)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=40, help="trainer steps per swarm")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--settle-steps", type=int, default=2, help="steps after the first 2:2 one left out")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--max-in-flight", type=int, default=8)
    parser.add_argument("--slowdown", type=float, default=60.0, help="--faults slowdown of every peer")
    parser.add_argument(
        "--slowdown-mode",
        default="device",
        choices=["device", "sleep"],
        help="--faults slowdown_mode of every peer (runs 1-5 and r1 in RESULTS.md used sleep)",
    )
    parser.add_argument("--rebalance-period-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--with-balanced",
        action="store_true",
        help="also run a swarm started 2:2 without rebalancing (the ceiling for 'after')",
    )
    parser.add_argument("--out", default="benchmarks/out/rebalance_loopback.json")
    args = parser.parse_args()
    # A SIGTERM (e.g. from `timeout`) unwinds the `with LocalSwarm` blocks, which stop every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    static = run_swarm(args, rebalance=False)
    print(
        f"static 3:1                {static['all_timed']['tokens_per_s']:>9,.0f} tokens/s "
        f"({static['all_timed']['steps']} steps, lost {static['microbatches_lost']})",
        flush=True,
    )
    balanced = None
    if args.with_balanced:  # the layout rebalancing aims at, started that way: what "after" can reach here
        balanced = run_swarm(args, rebalance=False, stages=(0, 0, 1, 1))
        print(
            f"static 2:2 (control)      {balanced['all_timed']['tokens_per_s']:>9,.0f} tokens/s "
            f"({balanced['all_timed']['steps']} steps, lost {balanced['microbatches_lost']}); "
            f"{balanced['all_timed']['tokens_per_s'] / static['all_timed']['tokens_per_s']:.2f}x static 3:1",
            flush=True,
        )
    moving = run_swarm(args, rebalance=True)
    before, after = moving["before"], moving["after"]
    print(
        f"rebalancing: before (3:1) {before['tokens_per_s'] or 0:>9,.0f} tokens/s ({before['steps']} steps)\n"
        f"rebalancing: after (2:2)  {after['tokens_per_s'] or 0:>9,.0f} tokens/s ({after['steps']} steps, "
        f"first 2:2 step {moving['first_balanced_step']}, lost {moving['microbatches_lost']})",
        flush=True,
    )
    for line in moving["moves"]:
        print(f"  {line}")
    ratio = after["tokens_per_s"] / before["tokens_per_s"] if before["tokens_per_s"] and after["tokens_per_s"] else None
    ratio_static = after["tokens_per_s"] / static["all_timed"]["tokens_per_s"] if after["tokens_per_s"] else None
    print(
        f"after / before: {ratio:.2f}x; after / static 3:1: {ratio_static:.2f}x"
        if ratio
        else "no before/after pair: the move came too early or too late for this --steps; see the JSON"
    )
    out = {
        "benchmark": "rebalance_loopback",
        "args": vars(args),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "static": static,
        "balanced_static": balanced,
        "rebalancing": moving,
        "after_over_before": ratio,
        "after_over_static": ratio_static,
    }
    write_report(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
