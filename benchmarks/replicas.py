"""Replicas and averaging (issue #4): does a stage served by 2 averaging replicas learn as well as
one peer, at an equal number of training samples?

    .venv/bin/python benchmarks/replicas.py --out benchmarks/out/replicas.json

Runs, one after the other, each a real loopback swarm (`LocalSwarm`) of the `small` model in 2
stages trained by `swarm train` on the Shakespeare corpus with the same data order:
* `1 replica`: one peer per stage (the reference);
* `2 replicas, sync`: two peers per stage averaging gradients on every step (`--averaging sync`);
* `2 replicas, periodic`: two peers per stage, each stepping on its half of every batch
  (`--target-batch-size` = batch / 2, so samples per step and steps per replica match the
  reference) and averaging parameters every `--period-s` seconds (`--averaging periodic`);
* with `--every-steps K [K ...]`, `2 replicas, periodic-every-K`: two peers per stage, each stepping
  on its share of every batch at the trainer's commit and averaging parameters right after every
  K-th step (`--averaging periodic --averaging-every-steps K`); these rounds do not depend on timing;
* optionally (`--with-outer`) `2 replicas, periodic + outer`: the same with a DiLoCo-style outer
  Nesterov step after each round (`--outer-lr`, `--outer-momentum`; DiLoCo's 0.7 and 0.9 by default);
* optionally (`--with-unaveraged`) `2 replicas, none`: the same without averaging, to show drift.

Per run: the trainer's loss per step, the final training loss (mean of the last 5 steps, on the same
batches in every run), and an evaluation loss of the final model on held-out windows (drawn with
another seed) computed here from the peers' exit checkpoints, replica 0 of each stage. For two
replicas, the largest parameter difference between them at the end. In periodic mode by time the
run waits for one more averaging round after training before stopping the peers, so the evaluated
model is an averaged one (by steps, the last round follows the last step when K divides --steps).
Loss figures depend on timing only slightly (periodic by time: through the rounds per step; every
run: a peer sums a step's microbatch gradients in arrival order, which over 120 steps moved the
1-replica reference by about 1%); the tokens/s printed alongside depend on it fully.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_metrics import scrape_peer  # noqa: E402
from benchmarks.process_cpu import cpu_spent, snapshot  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import build_stage  # noqa: E402
from peers.compute.checkpoint import checkpoint_path, load_checkpoint  # noqa: E402
from swarm.local_swarm import LocalSwarm  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, load_corpus  # noqa: E402

EVAL_SEED = 12345


def evaluation_loss(model_name: str, num_stages: int, stage_states: list[dict], samples: int) -> float:
    """Mean loss of the pipeline made of these stage parameters on `samples` held-out windows."""
    config = get_model_config(model_name)
    stages = []
    for stage, state in enumerate(stage_states):
        module = build_stage(config, stage, num_stages)
        module.load_state_dict(state)
        stages.append(module.eval())
    sampler = MicrobatchSampler(
        load_corpus(), seq_len=config.seq_len, batch_size=samples, microbatch_size=samples, seed=EVAL_SEED
    )
    (batch,) = sampler.batch(0)
    with torch.no_grad():
        x = batch.inputs
        for module in stages[:-1]:
            x = module(x)
        return float(stages[-1](x, batch.targets))


def max_param_difference(a: dict, b: dict) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def averaging_rounds(log: str) -> int:
    return len(re.findall("averaged parameters", log))


def averaging_bytes_sent(log: str) -> float | None:
    """What a peer's Prometheus endpoint says it sent for averaging (None if it cannot be read)."""
    samples = scrape_peer(log)
    if samples is None:
        return None
    return sum(
        s.value for s in samples if s.name == "swarm_peer_averaging_bytes_total" and s.labels.get("direction") == "sent"
    )


def run(
    name: str,
    args,
    replicas: int,
    averaging: str,
    extra_peer_args: tuple[str, ...] = (),
    extra_trainer_args: tuple[str, ...] = (),
) -> dict:
    """One layout's run in a fresh folder (logs, the trainer's report, the peers' checkpoints: about
    100 MB for `small`), removed once the run's figures are read; kept, and named, if the run fails."""
    workdir = tempfile.mkdtemp(prefix="swarm-replicas-")
    try:
        result = _run_in(workdir, name, args, replicas, averaging, extra_peer_args, extra_trainer_args)
    except BaseException:
        print(f"{name}: its logs are kept in {workdir}", flush=True)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def _run_in(
    workdir: str,
    name: str,
    args,
    replicas: int,
    averaging: str | None,
    extra_peer_args: tuple[str, ...],
    extra_trainer_args: tuple[str, ...],
) -> dict:
    report_path = os.path.join(workdir, "report.json")
    target = args.batch_size // replicas if averaging in ("periodic", "none") else args.batch_size
    by_steps = "--averaging-every-steps" in extra_peer_args
    schedule = ["--averaging-period-s", str(args.period_s)] if averaging == "periodic" and not by_steps else []
    peer_args = [
        "--target-batch-size",
        str(target),
        "--num-threads",
        "1",
        "--lr",
        str(args.lr),
        *(["--averaging", averaging] if averaging is not None else []),  # None: the peers' default
        *schedule,
        "--no-load-state",
        *extra_peer_args,
    ]
    print(f"--- {name}", flush=True)
    started = time.monotonic()
    # a local swarm is a run with an authority, where gloo (which authenticates nobody) may not be used
    authority = "gloo" not in extra_peer_args
    with LocalSwarm(
        model=args.model, num_stages=args.stages, workdir=workdir, peer_args=peer_args, run=authority
    ) as swarm:
        swarm.start_bootstrap()
        peers = {
            (s, r): swarm.start_peer(s, "--checkpoint-dir", os.path.join(workdir, f"ckpt-s{s}-r{r}"))
            for s in range(args.stages)
            for r in range(replicas)
        }
        swarm.wait_online(list(peers.values()))
        cpu_before = snapshot()
        trainer = swarm.start_trainer(
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--microbatch-size",
            str(args.microbatch_size),
            "--num-stages",
            str(args.stages),
            "--report",
            report_path,
            "--log-every",
            "10",
            *extra_trainer_args,
        )
        if trainer.popen.wait(timeout=args.run_timeout_s) != 0:
            raise RuntimeError(f"{name}: the trainer failed:\n{trainer.log()[-3000:]}")
        cpu_s = cpu_spent(cpu_before, snapshot())  # the trainer's whole life, start-up and final flush included
        if averaging == "periodic" and replicas > 1 and not by_steps:  # evaluate an averaged model: one more round
            done = {key: averaging_rounds(p.log()) for key, p in peers.items()}
            deadline = time.monotonic() + 4 * args.period_s + 30
            while time.monotonic() < deadline and not all(
                averaging_rounds(p.log()) > done[k] for k, p in peers.items()
            ):
                time.sleep(0.5)
        rounds = {f"stage{s}-replica{r}": averaging_rounds(p.log()) for (s, r), p in peers.items()}
        sent = {f"stage{s}-replica{r}": averaging_bytes_sent(p.log()) for (s, r), p in peers.items()}
        for peer in peers.values():
            peer.stop()  # a clean stop saves the exit checkpoint
    with open(report_path) as f:
        report = json.load(f)
    states = {
        key: load_checkpoint(
            checkpoint_path(os.path.join(workdir, f"ckpt-s{key[0]}-r{key[1]}"), args.model, key[0], args.stages)
        )[1]
        for key in peers
    }
    result = {
        "name": name,
        "replicas_per_stage": replicas,
        "averaging": averaging,
        "target_batch_size": target,
        "steps": report["steps"],
        "samples": report["steps"] * args.batch_size,
        "losses": report["losses"],
        "final_loss": report["final_loss"],
        "eval_loss": evaluation_loss(
            args.model, args.stages, [states[(s, 0)] for s in range(args.stages)], args.eval_samples
        ),
        "tokens_per_s": report["steps"]
        * args.batch_size
        * get_model_config(args.model).seq_len
        / sum(args.batch_size * get_model_config(args.model).seq_len / t for t in report["tokens_per_s_by_step"]),
        "report_tokens_per_s": report["tokens_per_s"],  # the whole training loop, start-up of the peers excluded
        "step_end_s": report["step_end_s"],
        "wall_s": time.monotonic() - started,
        "microbatches_lost": report["microbatches_lost"],
        "sync_round_retries": report.get("sync_round_retries", 0),
        "replica_catch_ups": report.get("replica_catch_ups", 0),
        # CPU seconds by kind of process from the trainer's start to its exit (benchmarks/process_cpu.py)
        "cpu_s": cpu_s,
        "cpu_s_per_step": {kind: round(seconds / max(report["steps"], 1), 4) for kind, seconds in cpu_s.items()},
    }
    if replicas > 1:
        result["max_param_difference_between_replicas"] = {
            f"stage{s}": max_param_difference(states[(s, 0)], states[(s, 1)]) for s in range(args.stages)
        }
    if averaging == "periodic":
        result["parameter_averaging_rounds"] = rounds
    if averaging != "none":
        result["averaging_bytes_sent"] = sent  # from each peer's swarm_peer_averaging_bytes_total
    print(
        f"{name}: final loss {result['final_loss']:.4f}, eval loss {result['eval_loss']:.4f}, "
        f"{result['tokens_per_s']:.0f} tokens/s, {result['wall_s']:.0f} s; CPU s a step: "
        + ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in result["cpu_s_per_step"].items())
        + f" (total {sum(result['cpu_s_per_step'].values()):.3f})",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--period-s", type=float, default=5.0, help="periodic mode: seconds between rounds")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--with-outer", action="store_true", help="also run periodic averaging with an outer step")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer learning rate (with --with-outer)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="outer momentum (with --with-outer)")
    parser.add_argument(
        "--only",
        nargs="*",
        help="run only the layouts whose names contain one of these words (the 1-replica reference always runs)",
    )
    parser.add_argument(
        "--every-steps",
        type=int,
        nargs="*",
        default=[],
        metavar="K",
        help="also run periodic averaging after every K local steps, one run per K (periodic-every-K)",
    )
    parser.add_argument("--with-unaveraged", action="store_true", help="also run 2 replicas without averaging")
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", default="benchmarks/out/replicas.json")
    args = parser.parse_args()
    if args.batch_size % (2 * args.microbatch_size):
        parser.error("--batch-size must be a multiple of 2 x --microbatch-size (two replicas share each batch)")

    layouts = [
        ("1 replica", 1, "none", ()),
        ("2 replicas, sync", 2, "sync", ()),
        ("2 replicas, periodic", 2, "periodic", ()),
    ]
    if args.with_outer:
        layouts.append(
            (
                f"2 replicas, periodic + outer {args.outer_lr}/{args.outer_momentum}",
                2,
                "periodic",
                ("--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)),
            )
        )
    for k in args.every_steps:
        layouts.append((f"2 replicas, periodic-every-{k}", 2, "periodic", ("--averaging-every-steps", str(k))))
    if args.with_unaveraged:
        layouts.append(("2 replicas, none", 2, "none", ()))
    if args.only:
        layouts = [layouts[0]] + [layout for layout in layouts[1:] if any(word in layout[0] for word in args.only)]
    load_before = os.getloadavg()
    print("machine load (1/5/15 min) before: " + " ".join(f"{x:.1f}" for x in load_before), flush=True)
    runs = [run(name, args, replicas, averaging, extra) for name, replicas, averaging, extra in layouts]
    load_after = os.getloadavg()
    print("machine load (1/5/15 min) after: " + " ".join(f"{x:.1f}" for x in load_after), flush=True)
    reference = runs[0]
    for result in runs:
        for key in ("final_loss", "eval_loss"):
            result[f"{key}_vs_1_replica"] = result[key] / reference[key] - 1

    print(f"\n{'run':<30}{'samples':>8}{'final loss':>12}{'vs 1':>8}{'eval loss':>11}{'vs 1':>8}{'tokens/s':>10}")
    for r in runs:
        print(
            f"{r['name']:<30}{r['samples']:>8}{r['final_loss']:>12.4f}{r['final_loss_vs_1_replica']:>+8.1%}"
            f"{r['eval_loss']:>11.4f}{r['eval_loss_vs_1_replica']:>+8.1%}{r['tokens_per_s']:>10.0f}"
        )
    every = max(args.steps // 10, 1)
    print("\nloss by step:\n" + f"{'step':>6}" + "".join(f"{r['name']:>30}" for r in runs))
    for step in sorted({*range(0, args.steps, every), args.steps - 1}):
        print(f"{step:>6}" + "".join(f"{r['losses'][step]:>30.4f}" for r in runs))

    write_report(
        args.out,
        {
            "args": vars(args),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "load_after": load_after,
            },
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
