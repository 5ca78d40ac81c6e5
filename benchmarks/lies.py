"""Plausible lies (issues #25, #59) against a live 2-stage swarm, beside clean runs in the same invocation.

    PYTHONPATH=. .venv/bin/python benchmarks/lies.py --steps 6 --out benchmarks/out/lies.json

Every row is a fresh `tiny` swarm on loopback with main's defaults (sync averaging), two honest
replicas of each stage, a trainer of `--steps` steps of 8 samples (microbatches of 2, one seed) and
the validation loss after the last step; `--routing hub direct` runs every row under each routing.
- clean: no liar, `--verify-fraction 0`: the baseline; then, on that swarm, throughput runs of
  `--cost-steps` at each of `--cost-fractions` (default none: see benchmarks/verify_cost.py).
- caught lies (`--modes`): a third replica lies on every answer (`garbage_size` 0.05, noise 0.03),
  checked at `--detect-fraction`: `last-*` at the last stage (loss, input gradient, gradient
  sample), `first-*` at stage 0, `backward` a stage-0 replica lying on its backwards alone. Per
  row: banned or not, the calls the liar answered before its ban, its checks, the loss against the
  clean run's (goal: within 2%), microbatches lost.
- `--pair`: the `last-scale` liar beside ONE honest replica: disputes reported, nobody banned.
- lies inside the bound (`--inside`): a last-stage liar at `--inside-share` (0.8) of its tolerance:
  `scale`, `bias` (one fixed direction: a lie that adds up), `bf16-bias` (the stage in bf16, the
  bias sized by the bf16 bound): its effect on the loss, with nobody banned.

Not shown: a few steps of a tiny model on a busy shared machine (the load is recorded); one seed;
each row its own swarm (its start differs in timing, not in weights); inside-bound lies over a
longer run (more steps give a consistent bias more time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.local_swarm import LocalSwarm, ManagedProcess, fault_args  # noqa: E402
from swarm.trainer.spot_checks import CHECK_PRECISION, tolerance  # noqa: E402

PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3"]  # averaging: the default (sync)
KINDS = ("scale", "noise", "replay", "stale")
SIZES = {"noise": 0.03}  # --faults garbage_size per kind (0.05 otherwise)
# row -> (the liar's stage, its lie, the calls it lies on)
MODES = {
    **{f"last-{kind}": (1, kind, "all") for kind in KINDS},
    **{f"first-{kind}": (0, kind, "all") for kind in KINDS},
    "backward": (0, "scale", "backward"),
}
# a last stage of the liar and one honest replica: every mismatch a dispute, nobody to settle it
PAIR = "pair-last-scale"
INSIDE = ("scale", "bias", "bf16-bias")
GOAL_LOSS_REL = 0.02
SEED = "3"


def peer_id(process: ManagedProcess) -> str | None:
    match = re.search(r"peer (\S+) online", process.log())
    return match.group(1) if match else None


def train(
    local: LocalSwarm, args, workdir: str, name: str, verify_fraction: float, *, steps: int, evaluate: bool
) -> dict:
    """One trainer on `local`'s swarm, to the end; its report (or what it wrote) and wall time."""
    report_path = os.path.join(workdir, f"{name}.report.json")
    started = time.monotonic()
    trainer = local.start_trainer(
        *("--steps", str(steps), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"),
        *("--refresh-period-s", "2", "--seed", SEED, "--report", report_path),
        *("--eval-every", str(steps if evaluate else 0), "--eval-batches", str(args.eval_batches)),
        *("--verify-fraction", str(verify_fraction), "--routing", args.routing),
        name=f"trainer-{name}",
    )
    try:
        code = trainer.popen.wait(timeout=args.timeout_s)
    except Exception:
        code = None
    try:
        with open(report_path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {}
    rates = report.get("tokens_per_s_by_step") or []
    return {
        "verify_fraction": verify_fraction,
        "steps": steps,
        "finished": code == 0 and bool(report.get("completed")),
        "wall_s": round(time.monotonic() - started, 1),
        "tokens_per_s": report.get("tokens_per_s"),
        "median_step_tokens_per_s": statistics.median(rates) if rates else None,
        "final_loss": report.get("final_loss"),
        "final_eval_loss": report.get("final_eval_loss"),
        "microbatches_lost": report.get("microbatches_lost"),
        "calls_verified": report.get("calls_verified"),
        "verify_mismatches": report.get("verify_mismatches"),
        "verify_calls": report.get("verify_calls"),
        "verify_records_missing": report.get("verify_records_missing"),
        "verify_disputes": report.get("verify_disputes"),
        "verify_disputes_unresolved": report.get("verify_disputes_unresolved"),
        "verify_largest_agreeing_difference": report.get("verify_largest_agreeing_difference"),
        "banned_peers": report.get("banned_peers", {}),
        "contributions": report.get("contributions", {}),
        **({} if code == 0 else {"trainer_log_tail": trainer.log()[-2000:]}),
    }


def honest_swarm(local: LocalSwarm, last_args: tuple[str, ...] = (), last_replicas: int = 2) -> list[ManagedProcess]:
    local.start_bootstrap()
    peers = [local.start_peer(0, name="peer-s0-a"), local.start_peer(0, name="peer-s0-b")]
    peers += [local.start_peer(1, *last_args, name=f"peer-s1-{'ab'[i]}") for i in range(last_replicas)]
    return peers


def clean_runs(args, root: str) -> list[dict]:
    workdir = os.path.join(root, f"clean-{args.routing}")
    os.makedirs(workdir)
    runs = []
    with LocalSwarm(workdir=workdir, model="tiny", num_stages=2, peer_args=PEER_ARGS) as local:
        local.wait_online(honest_swarm(local), timeout_s=300)
        baseline = train(local, args, workdir, "clean", 0.0, steps=args.steps, evaluate=True)
        runs.append({"run": "clean", **baseline})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "contributions"}), flush=True)
        for fraction in args.cost_fractions and (0.0, *args.cost_fractions):
            cost = train(local, args, workdir, f"cost-{fraction}", fraction, steps=args.cost_steps, evaluate=False)
            runs.append({"run": f"cost verify {fraction}", **cost})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "contributions"}), flush=True)
    return runs


def liar_run(
    name: str,
    args,
    root: str,
    stage: int,
    liar_args: list[str],
    fraction: float,
    last_args: tuple[str, ...] = (),
    last_replicas: int = 2,
) -> dict:
    """A fresh swarm with one liar (`liar_args`) beside the honest replicas of `stage`, one trainer."""
    workdir = os.path.join(root, f"{name}-{args.routing}")
    os.makedirs(workdir)
    with LocalSwarm(workdir=workdir, model="tiny", num_stages=2, peer_args=PEER_ARGS) as local:
        honest = honest_swarm(local, last_args, last_replicas)
        own = last_args if stage == 1 else ()
        liar = local.start_peer(stage, *own, *liar_args, name=f"peer-s{stage}-liar")
        local.wait_online([*honest, liar], timeout_s=300)
        run = {"run": name, **train(local, args, workdir, name, fraction, steps=args.steps, evaluate=True)}
        liar_id = peer_id(liar)
        counts = run["contributions"].get(liar_id or "", {})
        run.update(
            liar=liar_id,
            liar_stage=stage,
            liar_banned=liar_id in run["banned_peers"],
            # every call the liar answered came before its ban (none goes to it after)
            liar_calls_until_detection=counts.get("calls_answered"),
            liar_checks=counts.get("calls_verified"),
            liar_mismatches=counts.get("mismatches"),
            honest_banned=sorted(set(run["banned_peers"]) - {liar_id}),
        )
    print(json.dumps({k: v for k, v in run.items() if k != "contributions"}), flush=True)
    return run


def lying_run(mode: str, args, root: str) -> dict:
    stage, kind, calls = MODES[mode]
    liar_args = fault_args(garbage=kind, garbage_rate=1.0, garbage_calls=calls, garbage_size=SIZES.get(kind, 0.05))
    return {"mode": mode, **liar_run(mode, args, root, stage, liar_args, args.detect_fraction)}


def pair_run(name: str, args, root: str) -> dict:
    """The liar of `last-scale` beside one honest replica of the last stage: disputes, no ban."""
    liar_args = fault_args(garbage="scale", garbage_rate=1.0, garbage_size=0.05)
    return {"pair": name, **liar_run(name, args, root, 1, liar_args, args.detect_fraction, last_replicas=1)}


def inside_run(kind: str, args, root: str) -> dict:
    """A liar of the last stage lying by `--inside-share` of its tolerance: never caught."""
    bf16 = kind.startswith("bf16-")
    precision = "bf16" if bf16 else "fp32"
    size = args.inside_share * tolerance("none", (precision, CHECK_PRECISION))
    lie = kind.removeprefix("bf16-")
    liar_args = fault_args(garbage=lie, garbage_rate=1.0, garbage_size=round(size, 6))
    last_args = ("--precision", "bf16") if bf16 else ()
    run = liar_run(f"inside-{kind}", args, root, 1, liar_args, args.detect_fraction, last_args)
    return {"inside": kind, "lie_size": size, **run}


def judge(runs: list[dict]) -> None:
    """The cost runs against the cost run at --verify-fraction 0; the lying runs' validation loss
    against the clean run's (same steps, same seed)."""
    clean = runs[0]
    cost_base = next((r for r in runs if r["run"] == "cost verify 0.0"), None)
    for run in runs[1:]:
        if not (run["finished"] and clean["finished"]):
            run["meets_goal"] = False
            continue
        if run["run"].startswith("cost") and cost_base is not None and cost_base["finished"] and run is not cost_base:
            run["tokens_ratio"] = round(run["tokens_per_s"] / cost_base["tokens_per_s"], 3)
            run["median_step_ratio"] = round(run["median_step_tokens_per_s"] / cost_base["median_step_tokens_per_s"], 3)
        if (
            ("mode" in run or "inside" in run or "pair" in run)
            and clean["final_eval_loss"]
            and run["final_eval_loss"] is not None
        ):
            rel = (run["final_eval_loss"] - clean["final_eval_loss"]) / clean["final_eval_loss"]
            run["eval_loss_rel_diff"] = round(rel, 4)
            if "mode" in run:
                run["meets_goal"] = bool(run["liar_banned"] and abs(rel) <= GOAL_LOSS_REL and not run["honest_banned"])
            elif "pair" in run:  # two answers apart ban nobody: each is a dispute, reported
                run["meets_goal"] = not run["banned_peers"] and bool(run["verify_disputes"])
            else:  # a lie inside the bound: nobody banned; its effect on the loss is the figure
                run["meets_goal"] = not run["banned_peers"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--inside", nargs="*", default=list(INSIDE), choices=INSIDE)
    parser.add_argument("--pair", action="store_true", help=f"also the {PAIR} row (a liar and one honest replica)")
    parser.add_argument("--inside-share", type=float, default=0.8, help="of the tolerance, the inside lies' size")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--detect-fraction", type=float, default=0.2, help="--verify-fraction of the lying runs")
    parser.add_argument("--cost-steps", type=int, default=20, help="steps of each throughput run")
    parser.add_argument("--cost-fractions", type=float, nargs="*", default=[])
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per trainer")
    parser.add_argument("--routing", nargs="+", default=["hub"], choices=("hub", "direct"), dest="routings")
    parser.add_argument("--out", default="benchmarks/out/lies.json")
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="swarm-lies-") as root:
        for routing in args.routings:
            args.routing = routing
            group = clean_runs(args, root)
            rows = [(lying_run, mode, "mode") for mode in args.modes] + [(inside_run, k, "inside") for k in args.inside]
            rows += [(pair_run, PAIR, "pair")] if args.pair else []
            for run_row, name, key in rows:
                try:
                    group.append(run_row(name, args, root))
                except Exception as e:  # a swarm that could not start: say so, go on with the next row
                    group.append({"run": name, key: name, "finished": False, "error": f"{type(e).__name__}: {e}"})
            judge(group)
            runs += [{"routing": routing, **run} for run in group]
    write_report(
        args.out,
        {
            "command": " ".join(sys.argv),
            "steps": args.steps,
            "cost_steps": args.cost_steps,
            "detect_fraction": args.detect_fraction,
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "wall_s": round(time.monotonic() - started, 1),
            "runs": runs,
        },
    )
    return 0 if all(r.get("meets_goal", True) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
