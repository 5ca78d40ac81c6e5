"""Tokens/s of a loopback swarm next to one plain PyTorch process training the same model on the
same data, measured in one run.

    .venv/bin/python benchmarks/loopback.py --steps 20 --out benchmarks/out/loopback.json
    .venv/bin/python benchmarks/loopback.py --model tiny:200 small:30 --averaging none default

Layouts: 2 stages x 1 peer and 2 stages x 2 peers (each peer one torch thread; `swarm train
--routing` direct by default, as the trainer's, `hub`, or `both`), against one plain process with
1 thread and with one thread per core; the ratio is taken against the faster of the two. Several
models (each with its own timed steps) and several averaging modes of the 2x2 layout (one row
each; `default`: the peers' own default; `MODE/TRANSPORT` also sets their `--averaging-transport`) run side by side in one invocation. Each swarm row also
shows each peer's compute utilisation as the trainer's report states it. Warm-up steps are excluded
from timing. Run it on a quiet machine: on 2 cores, a 2-thread PyTorch process slows down many
times over when another process takes a core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import UnknownModelError, get_model_config  # noqa: E402
from models.stages import build_full_model  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings  # noqa: E402
from swarm.local_swarm import LocalSwarm  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, load_corpus  # noqa: E402

DEFAULT_AVERAGING = "default"  # pass no --averaging: the peers' own default


def parse_model(text: str, steps: int) -> tuple[str, int]:
    """MODEL or MODEL:STEPS (that model's timed steps; --steps otherwise)."""
    name, _, count = text.partition(":")
    if count and (not count.isdigit() or int(count) < 1):
        raise SystemExit(f"--model {text}: STEPS after the colon must be a positive whole number")
    try:
        get_model_config(name)  # an unknown model fails here, before any process starts
    except UnknownModelError as e:
        raise SystemExit(f"--model {text}: {e}") from None
    return name, int(count) if count else steps


def plain_pytorch(
    model_name: str, steps: int, warmup: int, batch_size: int, microbatch_size: int, threads: int
) -> dict:
    """The baseline a user would write: one process, gradient accumulation over the same microbatches."""
    torch.set_num_threads(threads)
    config = get_model_config(model_name)
    sampler = MicrobatchSampler(
        load_corpus(), seq_len=config.seq_len, batch_size=batch_size, microbatch_size=microbatch_size
    )
    model = build_full_model(config)
    optimizer = OptimizerSettings().build(model.parameters())
    losses, started = [], None
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        total = 0.0
        for mb in sampler.batch(step):
            loss = model(mb.inputs, mb.targets) * (mb.size / batch_size)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    elapsed = time.perf_counter() - started
    return {
        "layout": f"plain pytorch, {threads} thread(s)",
        "tokens_per_s": steps * batch_size * config.seq_len / elapsed,
        "final_loss": sum(losses[-5:]) / len(losses[-5:]),
        "threads": torch.get_num_threads(),
    }


def swarm_run(
    model_name: str,
    stages: int,
    replicas: int,
    steps: int,
    warmup: int,
    batch_size: int,
    microbatch_size: int,
    max_in_flight: int,
    routing: str = "direct",
    averaging: str = DEFAULT_AVERAGING,
) -> dict:
    workdir = tempfile.mkdtemp(prefix="swarm-bench-")
    report_path = os.path.join(workdir, "report.json")
    mode, _, transport = averaging.partition("/")  # MODE or MODE/TRANSPORT (--averaging-transport)
    averaging_args = [] if mode == DEFAULT_AVERAGING else ["--averaging", mode]
    averaging_args += ["--averaging-transport", transport] if transport else []
    with LocalSwarm(
        model=model_name,
        num_stages=stages,
        workdir=workdir,
        peer_args=["--target-batch-size", str(batch_size), "--num-threads", "1", *averaging_args],
    ) as swarm:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(s) for s in range(stages) for _ in range(replicas)]
        swarm.wait_online(peers)
        trainer = swarm.start_trainer(
            "--steps",
            str(warmup + steps),
            "--batch-size",
            str(batch_size),
            "--microbatch-size",
            str(microbatch_size),
            "--max-in-flight",
            str(max_in_flight),
            "--num-stages",
            str(stages),
            "--report",
            report_path,
            "--routing",
            routing,
        )
        if trainer.popen.wait(timeout=3600) != 0:
            raise RuntimeError(f"trainer failed:\n{trainer.log()[-3000:]}")
    with open(report_path) as f:
        report = json.load(f)
    timed = report["tokens_per_s_by_step"][warmup:]
    # tokens/s over the timed steps = total tokens / total time of those steps
    seconds = sum(batch_size * get_model_config(model_name).seq_len / t for t in timed)
    layout = f"swarm {stages} stages x {replicas} peer(s)" + (", direct" if routing == "direct" else "")
    if replicas > 1:
        layout += f", averaging {averaging}"
    return {
        "layout": layout,
        "model": model_name,
        "routing": routing,
        "averaging": averaging if replicas > 1 else None,
        # the mode each stage's replicas ran, as the trainer's report states it
        "averaging_by_stage": report.get("averaging_by_stage", {}),
        # what crossed the trainer's own link (sent and received), per token trained
        "trainer_link_bytes_per_token": report["wire_bytes_per_token"],
        "tokens_per_s": len(timed) * batch_size * get_model_config(model_name).seq_len / seconds,
        "final_loss": report["final_loss"],
        "microbatches_lost": report["microbatches_lost"],
        "microbatches_retried": report["microbatches_retried"],
        # each peer's compute utilisation as the trainer's report states it (busy fraction between its
        # first and last answers to the trainer, warm-up steps included)
        "peer_utilization": {
            peer[-8:]: c.get("utilization")
            for peer, c in sorted(report["contributions"].items(), key=lambda i: i[1]["stage"])
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", nargs="+", default=["small"], help="models, run one after the other: MODEL or MODEL:STEPS"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (a model's :STEPS wins)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--max-in-flight", type=int, default=8)
    parser.add_argument(
        "--routing",
        default="direct",
        choices=["hub", "direct", "both"],
        help="swarm train --routing of the swarm layouts; both: each layout with each, hub first",
    )
    parser.add_argument(
        "--averaging",
        nargs="+",
        default=[DEFAULT_AVERAGING],
        help="the 2x2 layout's peer --averaging, one row each (none, sync, outer, auto...; default: the peers' own), "
        "each as MODE or MODE/TRANSPORT (the peers' --averaging-transport: default/hivemind, sync/exchange...)",
    )
    parser.add_argument("--out", default="benchmarks/out/loopback.json")
    args = parser.parse_args()
    models = [parse_model(text, args.steps) for text in args.model]
    routings = ["hub", "direct"] if args.routing == "both" else [args.routing]
    layouts = [(1, routing, DEFAULT_AVERAGING) for routing in routings]
    layouts += [(2, routing, averaging) for routing in routings for averaging in args.averaging]

    results = []
    for model_name, steps in models:
        plain_results = []
        for threads in sorted({1, os.cpu_count() or 1}):
            plain_results.append(
                plain_pytorch(model_name, steps, args.warmup, args.batch_size, args.microbatch_size, threads)
            )
            plain_results[-1]["model"] = model_name
            print(
                f"{model_name:<6} {plain_results[-1]['layout']:<44} {plain_results[-1]['tokens_per_s']:>9,.0f} tokens/s",
                flush=True,
            )
        model_results = list(plain_results)
        for replicas, routing, averaging in layouts:
            model_results.append(
                swarm_run(
                    model_name,
                    2,
                    replicas,
                    steps,
                    args.warmup,
                    args.batch_size,
                    args.microbatch_size,
                    args.max_in_flight,
                    routing,
                    averaging,
                )
            )
            print(
                f"{model_name:<6} {model_results[-1]['layout']:<44} {model_results[-1]['tokens_per_s']:>9,.0f} tokens/s",
                flush=True,
            )
        baseline = max(r["tokens_per_s"] for r in plain_results)  # compare with the stronger plain setting
        for r in model_results:
            r["steps"] = steps
            r["ratio_to_plain"] = r["tokens_per_s"] / baseline
        results += model_results
    print(
        "\nmodel  layout                                        tokens/s   ratio   final loss   "
        "trainer link bytes/token   peers busy   averaging by stage"
    )
    for r in results:
        link = f"{r['trainer_link_bytes_per_token']:>12,.0f}" if "trainer_link_bytes_per_token" in r else ""
        busy = " ".join("-" if u is None else f"{u:.0%}" for u in r.get("peer_utilization", {}).values())
        modes = "; ".join(f"{stage}: {mode}" for stage, mode in r.get("averaging_by_stage", {}).items())
        print(
            f"{r['model']:<6} {r['layout']:<44} {r['tokens_per_s']:>9,.0f}   {r['ratio_to_plain']:.2f}    "
            f"{r['final_loss']:.3f}   {link:>24}   {busy:<10}   {modes}"
        )
    out = {
        "benchmark": "loopback",
        "models": [name for name, _ in models],
        "model": models[0][0],
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "microbatch_size": args.microbatch_size,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "results": results,
    }
    write_report(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
