"""Where a microbatch's wall time and CPU go, in each process of a loopback swarm, on each path.

    .venv/bin/python benchmarks/microbatch_profile.py --out benchmarks/out/microbatch_profile.json

One swarm of 2 stages x 1 peer (each peer one torch thread), then, side by side in one invocation,
one trainer per (path, microbatch size): `hub` and `direct` routing by default (`--path NAME=ARGS`
adds a row of other trainer flags, e.g. a transport; `--peer-args` applies to the swarm), over
microbatch sizes that sweep a hop from `tiny`'s 16 KB (4 samples of 32 tokens x 32 floats) to
gpt2-124m's 6 MB (1536 samples). For each trainer the timed stretch starts after its warm-up steps
and ends before its last step (so that every process is still alive to be read). Per microbatch:

* CPU milliseconds of every process (psutil): the trainer, each peer, their DHT helpers and their
  p2pd daemons;
* each peer's phases (`swarm_peer_phase_*`, peers/metrics.py PHASES): receive, decode, queue,
  compute (and the device copies inside it), encode, serialize, send, hop_wait, hop_decode; the
  trainer's (encode, decode, call); each peer's compute utilisation (`swarm_peer_compute_busy_*`)
  and its idle time (waiting for work);
* the bytes its calls moved (every sender's byte counter) and the calls it took (the peers'
  request counters).

Then, per path, a least-squares line through the sizes: the CPU of the plumbing (every process's
CPU but the peers' compute and the DHT helpers' background work), per microbatch, against the MB it
moved: the intercept over the calls per microbatch is the fixed CPU cost of a call, the slope the
CPU per MB, summed over every process a hop involves (p2pd apart too). Both next to the floors of
issue #55 (raw TCP 0.9 ms/MB, a p2pd stream 5.3 ms/MB, gloo 1.3 ms/MB).

`--device cuda` runs the peers on the GPU (`--precision`, `--model gpt2-124m --sizes 1 2 4` for
its rows); on 2 CPU cores the figures of a row are its CPU's, the wall times those of a loaded
machine. The machine's load is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_metrics import scrape_peer  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import boundary_width  # noqa: E402
from swarm.local_swarm import LocalSwarm, ManagedProcess  # noqa: E402

PATHS = {"hub": ["--routing", "hub"], "direct": ["--routing", "direct"]}
FLOORS_MS_PER_MB = {"raw asyncio TCP": 0.9, "hivemind P2P stream (2 p2pd)": 5.3, "torch.distributed gloo": 1.3}
GOALS = {"cpu_ms_per_call": 1.0, "cpu_ms_per_mb": 2.5}
POLL_S = 0.01


@dataclass(frozen=True)
class Point:
    path: str
    microbatch_size: int
    microbatches_per_step: int
    steps: int


def plan(paths: list[str], sizes: list[int], samples: int, warmup: int) -> list[Point]:
    """Each size gets at least `samples` timed samples (4 to 20 steps), up to 8 microbatches a step."""
    points = []
    for size in sizes:
        per_step = max(1, min(8, 256 // size))
        steps = max(4, min(20, math.ceil(samples / (size * per_step))))
        points += [Point(path, size, per_step, steps) for path in paths]
    return points


def cpu_by_process(processes: dict[str, ManagedProcess]) -> dict[str, float]:
    """CPU seconds (user + system) of each named process and its descendants, by kind: `<name>`
    (the process itself), `<name> p2pd`, `<name> helpers` (hivemind's DHT process and the like)."""
    out: dict[str, float] = {}
    for name, process in processes.items():
        try:
            root = psutil.Process(process.popen.pid)
            times = root.cpu_times()
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        out[name] = times.user + times.system
        out.setdefault(f"{name} p2pd", 0.0)
        out.setdefault(f"{name} helpers", 0.0)
        for child in children:
            try:  # a child may end between the listing and the reading (not counted then)
                kind = f"{name} p2pd" if child.name() == "p2pd" else f"{name} helpers"
                t = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            out[kind] += t.user + t.system
    return out


def metric_totals(samples) -> dict:
    """What the profile reads from one process's metrics: phases, busy seconds, bytes, requests."""
    out = {"phase_wall": {}, "phase_cpu": {}, "phase_calls": {}, "busy_s": 0.0, "sent_bytes": 0.0, "requests": 0.0}
    for s in samples or []:
        phase = s.labels.get("phase")
        if s.name.endswith("_phase_seconds_total"):
            out["phase_wall"][phase] = s.value
        elif s.name.endswith("_phase_cpu_seconds_total"):
            out["phase_cpu"][phase] = s.value
        elif s.name.endswith("_phase_calls_total"):
            out["phase_calls"][phase] = s.value
        elif s.name == "swarm_peer_compute_busy_seconds_total":
            out["busy_s"] = s.value
        elif s.name in ("swarm_peer_sent_bytes_total", "swarm_trainer_sent_bytes_total"):
            out["sent_bytes"] += s.value
        elif s.name == "swarm_peer_requests_total" and s.labels.get("rpc") != "chain_piece":
            out["requests"] += s.value
    return out


def delta(after: dict, before: dict) -> dict:
    if isinstance(after, dict):
        return {k: delta(v, before.get(k, 0.0 if not isinstance(v, dict) else {})) for k, v in after.items()}
    return after - before


def read_steps(report_path: str) -> int:
    try:
        with open(report_path) as f:
            return int(json.load(f).get("steps", 0))
    except (OSError, ValueError):
        return 0


def snapshot(swarm_processes: dict[str, ManagedProcess], trainer: ManagedProcess) -> dict:
    processes = {**swarm_processes, "trainer": trainer}
    metrics = {name: metric_totals(scrape_peer(p.log())) for name, p in processes.items()}
    return {"at": time.perf_counter(), "cpu": cpu_by_process(processes), "metrics": metrics}


def wait_for_step(report_path: str, step: int, trainer: ManagedProcess, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        steps = read_steps(report_path)
        if steps >= step:
            return steps
        if not trainer.alive:
            raise RuntimeError(f"the trainer exited at step {steps}:\n{trainer.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the trainer did not reach step {step} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def run_point(swarm: LocalSwarm, peers: dict[str, ManagedProcess], point: Point, trainer_args: list[str], warmup: int):
    report_path = os.path.join(swarm.workdir, f"report-{point.path}-{point.microbatch_size}.json")
    batch = point.microbatch_size * point.microbatches_per_step
    trainer = swarm.start_trainer(
        *("--steps", str(warmup + point.steps + 1)),  # + 1: the timed stretch ends with every process alive
        *("--batch-size", str(batch), "--microbatch-size", str(point.microbatch_size)),
        *("--num-stages", "2", "--report", report_path, "--metrics-port", "0"),
        *trainer_args,
        name=f"trainer-{point.path}-{point.microbatch_size}",
    )
    try:
        first = wait_for_step(report_path, warmup, trainer, 600)
        before = snapshot(peers, trainer)
        last = wait_for_step(report_path, warmup + point.steps, trainer, 1800)
        after = snapshot(peers, trainer)
        if trainer.popen.wait(timeout=600) != 0:
            raise RuntimeError(f"the trainer failed:\n{trainer.log()[-3000:]}")
    finally:
        trainer.stop()
    microbatches = (last - first) * point.microbatches_per_step
    return summarize(point, before, after, microbatches)


def summarize(point: Point, before: dict, after: dict, microbatches: int) -> dict:
    wall_s = after["at"] - before["at"]
    cpu = {k: (v - before["cpu"].get(k, 0.0)) * 1e3 / microbatches for k, v in sorted(after["cpu"].items())}
    metrics = delta(after["metrics"], before["metrics"])
    peers = sorted(k for k in metrics if k.startswith("peer"))
    per_mb = 1e3 / microbatches
    phases = {
        name: {
            phase: {
                "wall_ms": round(wall * per_mb, 3),
                "cpu_ms": round(metrics[name]["phase_cpu"].get(phase, 0.0) * per_mb, 3),
            }
            for phase, wall in sorted(metrics[name]["phase_wall"].items())
        }
        for name in [*peers, "trainer"]
    }
    compute_cpu_ms = sum(metrics[p]["phase_cpu"].get("compute", 0.0) for p in peers) * per_mb
    helpers_ms = sum(v for k, v in cpu.items() if k.endswith("helpers"))
    total_ms = sum(cpu.values())
    moved_mb = sum(m["sent_bytes"] for m in metrics.values()) / microbatches / 2**20
    utilization = {p: round(metrics[p]["busy_s"] / wall_s, 4) for p in peers}
    return {
        "path": point.path,
        "microbatch_size": point.microbatch_size,
        "microbatches": microbatches,
        "hop_kb": None,  # filled in by main (it knows the model)
        "wall_ms_per_microbatch": round(wall_s * per_mb, 3),
        "calls_per_microbatch": round(sum(metrics[p]["requests"] for p in peers) / microbatches, 3),
        "mb_moved_per_microbatch": round(moved_mb, 4),
        "cpu_ms_per_microbatch": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_ms_total": round(total_ms, 3),
        "compute_cpu_ms": round(compute_cpu_ms, 3),
        "plumbing_cpu_ms": round(total_ms - compute_cpu_ms - helpers_ms, 3),
        "p2pd_cpu_ms": round(sum(v for k, v in cpu.items() if k.endswith("p2pd")), 3),
        "utilization": utilization,
        "idle_ms": {p: round((wall_s - metrics[p]["busy_s"]) * per_mb, 3) for p in peers},
        "phases": phases,
    }


def fit(rows: list[dict], key: str) -> dict:
    """Least squares `key` = a + b * MB moved, over one path's sizes; a per call, b per MB."""
    xs, ys = [r["mb_moved_per_microbatch"] for r in rows], [r[key] for r in rows]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")
    intercept = mean_y - slope * mean_x
    calls = sum(r["calls_per_microbatch"] for r in rows) / n
    return {
        "ms_per_microbatch_fixed": round(intercept, 3),
        "calls_per_microbatch": round(calls, 3),
        "ms_per_call": round(intercept / calls, 3) if calls else None,
        "ms_per_mb": round(slope, 3),
    }


def parse_paths(names: list[str], extra: list[str]) -> dict[str, list[str]]:
    paths = {name: PATHS[name] for name in names}
    for item in extra:
        name, _, args = item.partition("=")
        if not name or not args:
            raise SystemExit(f"--path {item!r}: expected NAME=TRAINER ARGS, e.g. 'wire=--routing direct --x y'")
        paths[name] = args.split()
    return paths


def print_tables(rows: list[dict], fits: dict) -> None:
    print("\npath     mb  hop KB   wall ms/mb   CPU ms/mb (plumbing, p2pd, compute)   calls/mb   util (peers)")
    for r in rows:
        util = " ".join(f"{v:.0%}" for v in r["utilization"].values())
        print(
            f"{r['path']:<7} {r['microbatch_size']:>4} {r['hop_kb']:>7.0f} {r['wall_ms_per_microbatch']:>11.1f}   "
            f"{r['plumbing_cpu_ms']:>8.1f} {r['p2pd_cpu_ms']:>8.1f} {r['compute_cpu_ms']:>8.1f}"
            f"           {r['calls_per_microbatch']:>6.2f}   {util}"
        )
    print("\nfixed CPU per call and CPU per MB (all processes of the path; python = trainer + peers)")
    for path, parts in fits.items():
        for part, f in parts.items():
            print(f"{path:<7} {part:<9} {f['ms_per_call']:>7.2f} ms/call   {f['ms_per_mb']:>7.2f} ms/MB")
    print("floors (ms/MB): " + ", ".join(f"{k} {v}" for k, v in FLOORS_MS_PER_MB.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64, 256, 1536], help="microbatch sizes")
    parser.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS), help="none: only --path rows")
    parser.add_argument("--path", action="append", default=[], help="another row: NAME=TRAINER ARGS")
    parser.add_argument("--samples", type=int, default=2048, help="timed samples per size (4 to 20 steps)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--device", default="cpu", help="the peers' --device (cuda: the GPU rows)")
    parser.add_argument("--precision", default="fp32", help="the peers' --precision")
    parser.add_argument("--peer-args", default="", help="more flags for every peer")
    parser.add_argument("--out", default="benchmarks/out/microbatch_profile.json")
    args = parser.parse_args()

    paths = parse_paths(args.paths, args.path)
    if not paths:
        raise SystemExit("no rows: give --paths or --path")
    config = get_model_config(args.model)
    hop_bytes = config.seq_len * boundary_width(config) * 4  # per sample, float32 on the wire
    load_before = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="swarm-profile-")
    peer_args = [
        *("--num-threads", "1", "--max-batch-size", str(max(args.sizes) * 8)),
        *("--device", args.device, "--precision", args.precision, "--metrics-port", "0"),
        *args.peer_args.split(),
    ]
    rows = []
    with LocalSwarm(model=args.model, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        peers = {f"peer{stage}": swarm.start_peer(stage) for stage in range(2)}
        swarm.wait_online(list(peers.values()))
        for point in plan(list(paths), args.sizes, args.samples, args.warmup):
            row = run_point(swarm, peers, point, paths[point.path], args.warmup)
            row["hop_kb"] = point.microbatch_size * hop_bytes / 1024
            rows.append(row)
            print(
                f"{row['path']:<7} {row['microbatch_size']:>5} samples ({row['hop_kb']:,.0f} KB hops): "
                f"{row['wall_ms_per_microbatch']:.1f} ms and {row['cpu_ms_total']:.1f} CPU ms per microbatch",
                flush=True,
            )
    fits = {
        path: {
            "plumbing": fit([r for r in rows if r["path"] == path], "plumbing_cpu_ms"),
            "p2pd": fit([r for r in rows if r["path"] == path], "p2pd_cpu_ms"),
        }
        for path in paths
    }
    for path, parts in fits.items():
        parts["python"] = {
            "ms_per_call": round(parts["plumbing"]["ms_per_call"] - parts["p2pd"]["ms_per_call"], 3),
            "ms_per_mb": round(parts["plumbing"]["ms_per_mb"] - parts["p2pd"]["ms_per_mb"], 3),
        }
    print_tables(rows, fits)
    write_report(
        args.out,
        {
            "benchmark": "microbatch_profile",
            "model": args.model,
            "device": args.device,
            "precision": args.precision,
            "paths": paths,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "floors_ms_per_mb": FLOORS_MS_PER_MB,
            "goals": GOALS,
            "rows": rows,
            "fits": fits,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
