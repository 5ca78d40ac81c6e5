"""Attacks of issue #30 against a live 2-stage swarm, beside a clean run in the same invocation.

    PYTHONPATH=. .venv/bin/python benchmarks/attacks.py --steps 20 --out benchmarks/out/attacks.json

Every run starts a fresh `tiny` swarm on loopback (one honest peer per stage), adds the attack's
processes, and trains the same steps with the same seed. Per run: tokens/s, final loss, the peak
RSS of the honest peers and of the trainer (VmHWM, read just before they stop), whether the run
finished, and the trainer's failures by kind. Goals (issue #30): tokens/s >= 0.8 of clean, final
loss within 2% of clean, peak RSS < 200 MB above clean.

Attacks here (the trainer trusts measurements, not claims):
- lying_replica: a stage-1 replica 10x slower than the honest one (`--fault-slowdown 10
  --fault-slowdown-mode device`) that announces 1000x its throughput and reports compute times 1000x
  shorter (`--fault-claim-speedup 1000`). Before: it drew 479 of 480 calls, throughput / 10.
- fake_wrong_stage: `--fakes` stage-1 records announcing 1000x throughput whose peers answer every
  call "wrong stage" (`--fault-wrong-stage`). Before: never banned, throughput / 100 with nine.

More attacks are more entries of `ATTACKS`: a name, and a function that starts the attack's
processes in a swarm whose honest peers are online.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.local_swarm import LocalSwarm, ManagedProcess  # noqa: E402

# Replicas do not average here: in sync averaging, a stage with a second replica (the liar, or the
# fakes) pays for averaging rounds at every commit, which would be charged to the attack (a first
# run with sync averaging spent most of its time in failed rounds: "could not find a group").
# Who may join averaging is issue #30's averager authorizer (branch `authority`).
PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3", "--averaging", "none"]
GOAL_TOKENS_RATIO, GOAL_LOSS_REL, GOAL_RSS_MB = 0.8, 0.02, 200.0


def peak_rss_mb(process: ManagedProcess) -> float | None:
    """The process's peak resident memory so far (VmHWM), in MB; None once it has exited."""
    try:
        with open(f"/proc/{process.popen.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def no_attack(swarm: LocalSwarm, args) -> list[ManagedProcess]:
    return []


def lying_replica(swarm: LocalSwarm, args) -> list[ManagedProcess]:
    return [
        swarm.start_peer(
            1,
            *("--fault-slowdown", "10", "--fault-slowdown-mode", "device", "--fault-claim-speedup", "1000"),
            "--no-load-state",
            name="liar",
        )
    ]


def fake_wrong_stage(swarm: LocalSwarm, args) -> list[ManagedProcess]:
    return [
        swarm.start_peer(1, "--fault-wrong-stage", "--fault-claim-speedup", "1000", "--no-load-state", name=f"fake{i}")
        for i in range(args.fakes)
    ]


ATTACKS: dict[str, Callable[[LocalSwarm, argparse.Namespace], list[ManagedProcess]]] = {
    "clean": no_attack,
    "lying_replica": lying_replica,
    "fake_wrong_stage": fake_wrong_stage,
}


def one_run(name: str, args, workdir: str) -> dict:
    report_path = os.path.join(workdir, "report.json")
    with LocalSwarm(workdir=workdir, model="tiny", num_stages=2, peer_args=PEER_ARGS) as swarm:
        swarm.start_bootstrap()
        honest = [swarm.start_peer(0), swarm.start_peer(1)]
        swarm.wait_online(honest)
        attackers = ATTACKS[name](swarm, args)
        if attackers:
            swarm.wait_online(attackers, timeout_s=300)
        started = time.monotonic()
        trainer = swarm.start_trainer(
            *("--steps", str(args.steps), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"),
            *("--refresh-period-s", "2", "--seed", "3", "--report", report_path),
        )
        trainer_rss = 0.0
        deadline = started + args.timeout_s
        while trainer.alive and time.monotonic() < deadline:
            trainer_rss = max(trainer_rss, peak_rss_mb(trainer) or 0.0)
            time.sleep(0.5)
        finished = trainer.popen.poll() == 0
        peers_rss = max((peak_rss_mb(p) or 0.0) for p in honest)
        try:
            report = json.loads(open(report_path).read())
        except (OSError, ValueError):
            report = {}
    return {
        "attack": name,
        "finished": finished and bool(report.get("completed")),
        "wall_s": round(time.monotonic() - started, 1),
        "tokens_per_s": report.get("tokens_per_s"),
        "final_loss": report.get("final_loss"),
        "peak_peer_rss_mb": round(peers_rss, 1),
        "peak_trainer_rss_mb": round(trainer_rss, 1),
        "failures_by_kind": report.get("failures_by_kind", {}),
        "calls_by_peer": report.get("calls_by_peer", {}),
    }


def judge(run: dict, clean: dict) -> dict:
    """Each goal of issue #30, against the clean run of the same invocation."""
    if not (run["finished"] and clean["finished"]):
        return {"meets_goals": False}
    ratio = run["tokens_per_s"] / clean["tokens_per_s"]
    loss_rel = abs(run["final_loss"] - clean["final_loss"]) / clean["final_loss"]
    rss_over = max(
        run["peak_peer_rss_mb"] - clean["peak_peer_rss_mb"], run["peak_trainer_rss_mb"] - clean["peak_trainer_rss_mb"]
    )
    return {
        "tokens_ratio": round(ratio, 3),
        "loss_rel_diff": round(loss_rel, 4),
        "rss_over_clean_mb": round(rss_over, 1),
        "meets_goals": ratio >= GOAL_TOKENS_RATIO and loss_rel <= GOAL_LOSS_REL and rss_over < GOAL_RSS_MB,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", nargs="+", default=[a for a in ATTACKS if a != "clean"], choices=list(ATTACKS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fakes", type=int, default=9, help="fake wrong-stage records (peers)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--out", default="benchmarks/out/attacks.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="swarm-attacks-") as root:
        for name in ["clean", *[a for a in args.attacks if a != "clean"]]:
            run = one_run(name, args, os.path.join(root, name))
            print(json.dumps(run), flush=True)
            runs.append(run)
    clean = runs[0]
    for run in runs[1:]:
        run.update(judge(run, clean))
    write_report(
        args.out,
        {
            "command": " ".join(sys.argv),
            "steps": args.steps,
            "fakes": args.fakes,
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "runs": runs,
        },
    )
    return 0 if all(r.get("meets_goals", True) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
