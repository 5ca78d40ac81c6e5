"""One trainer against two on the same peers (issue #22): a 2 stages x 2 replicas swarm with sync
averaging, fed the same number of steps of the same batch by one trainer, then by two trainers on
disjoint data shards (`--data-shard 0/2` and `1/2`) running at once, which take the run's steps
together (one global step: a step ends when both trainers' samples reach the batch).

    .venv/bin/python benchmarks/trainers.py --out benchmarks/out/trainers.json

Each layout is a fresh loopback swarm (`LocalSwarm`, `--no-load-state`, one torch thread per peer).
The run's tokens/s is the tokens every trainer trained (its report's, so the few samples a global
step takes past the batch count) over the wall time from starting the trainer(s) to the last one's
exit (DHT join included, the same in both layouts); each trainer's own tokens/s is its report's.
The sync rounds each stage-0 replica completed (its Prometheus counter) are recorded: one per global
step in both layouts. The machine's load
(1/5/15 min) is recorded before and after each layout.

With `--verify-fraction F` every trainer spot-checks its calls, and each report's checks,
mismatches, disputes and bans are recorded: every peer is honest, so each mismatch is an honest
answer judged a lie (with several trainers, a commit of another trainer can land between a call and
its recompute, which is then not compared: counted stale). `--last-replicas 3` gives the last stage
three replicas, where a mismatch can ban.

    .venv/bin/python benchmarks/trainers.py --model tiny --steps 100 --verify-fraction 0.2 --last-replicas 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.local_swarm import LocalSwarm  # noqa: E402


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def sync_rounds(peer) -> int:
    """The sync averaging rounds a peer completed, from its Prometheus endpoint."""
    match = re.search(r"metrics on (http://\S+/metrics)", peer.log())
    if not match:
        return -1
    with urllib.request.urlopen(match.group(1), timeout=10) as response:
        text = response.read().decode()
    return int(
        sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "swarm_peer_averaging_rounds_total" and s.labels.get("result") == "ok"
        )
    )


def run(name: str, args, shards: int) -> dict:
    workdir = tempfile.mkdtemp(prefix="swarm-trainers-")
    peer_args = ["--target-batch-size", str(args.batch_size), "--num-threads", "1", "--lr", str(args.lr)]
    peer_args += ["--averaging", "sync", "--no-load-state"]
    print(f"--- {name}", flush=True)
    load_before = load()
    with LocalSwarm(model=args.model, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(stage) for stage in (0, 0, *[1] * args.last_replicas)]
        swarm.wait_online(peers)
        started = time.monotonic()
        trainers = []
        for shard in range(shards):
            report = os.path.join(workdir, f"report-{shard}.json")
            process = swarm.start_trainer(
                *("--steps", str(args.steps), "--batch-size", str(args.batch_size)),
                *("--microbatch-size", str(args.microbatch_size), "--num-stages", "2", "--log-every", "10"),
                *("--data-shard", f"{shard}/{shards}", "--report", report),
                *("--verify-fraction", str(args.verify_fraction)),
                name=f"trainer-{shard}",
            )
            trainers.append((process, report))
        for process, _ in trainers:
            if process.popen.wait(timeout=args.run_timeout_s) != 0:
                raise RuntimeError(f"{name}: a trainer failed:\n{process.log()[-3000:]}")
        wall_s = time.monotonic() - started
        rounds = [sync_rounds(p) for p in peers[:2]]
    reports = []
    for _, path in trainers:
        with open(path) as f:
            reports.append(json.load(f))
    tokens = sum(r["tokens"] for r in reports)
    return {
        "name": name,
        "trainers": shards,
        "steps_per_trainer": [r["steps"] for r in reports],
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "run_tokens_per_s": tokens / wall_s,
        "trainer_tokens_per_s": [round(r["tokens_per_s"]) for r in reports],
        "final_losses": [r["final_loss"] for r in reports],
        "microbatches_lost": sum(r["microbatches_lost"] for r in reports),
        "stage0_rounds": rounds,
        "calls_verified": sum(r.get("calls_verified", 0) for r in reports),
        "verify_mismatches": sum(r.get("verify_mismatches", 0) for r in reports),
        "verify_disputes": sum(r.get("verify_disputes", 0) for r in reports),
        "verify_stale": sum(r.get("verify_stale", 0) for r in reports),
        "honest_banned": sorted({peer for r in reports for peer in r.get("banned_peers", {})}),
        "load_before": load_before,
        "load_after": load(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=20, help="the run's steps (global steps, with two trainers)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--verify-fraction", type=float, default=0.0, help="every trainer's --verify-fraction")
    parser.add_argument("--last-replicas", type=int, default=2, help="replicas of the last stage")
    parser.add_argument("--out", default="benchmarks/out/trainers.json")
    args = parser.parse_args()
    runs = [run("1 trainer", args, 1), run("2 trainers", args, 2)]
    print(
        f"\n{'run':<12}{'run tok/s':>10}{'wall s':>8}{'trainers tok/s':>18}{'rounds (s0)':>13}{'lost':>6}"
        f"{'checked':>9}{'mismatches':>12}{'disputes':>10}{'stale':>7}{'banned':>8}"
    )
    for r in runs:
        print(
            f"{r['name']:<12}{r['run_tokens_per_s']:>10.0f}{r['wall_s']:>8.1f}{str(r['trainer_tokens_per_s']):>18}"
            f"{str(r['stage0_rounds']):>13}{r['microbatches_lost']:>6}{r['calls_verified']:>9}"
            f"{r['verify_mismatches']:>12}{r['verify_disputes']:>10}{r['verify_stale']:>7}{len(r['honest_banned']):>8}"
        )
    write_report(
        args.out,
        {"args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "runs": runs},
    )


if __name__ == "__main__":
    main()
