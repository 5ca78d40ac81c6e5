"""Attacks of issues #30 and #60 against a live 2-stage swarm on the defaults, beside clean runs in the
same invocation.

    PYTHONPATH=. .venv/bin/python benchmarks/attacks.py --steps 20 --out benchmarks/out/attacks.json

Every run starts a fresh `tiny` swarm on loopback as `LocalSwarm` starts one, that is on the defaults:
an open run with an authority (swarm/local_swarm.py), sync averaging, direct routing with a tenth of the
microbatches hub-timed. One peer of stage 0 and `--replicas` of stage 1 and the trainer are the run's
owner's (each issues itself a credential); the attackers are strangers (the run's public file, no
credential) unless a row says otherwise. The attack's processes start, then the trainer trains the
same steps with the same seed; a row's `during` attack starts once the trainer has done
`--join-at-step` steps. Rows of the `periodic` configuration run with periodic averaging of
parameters every 2 steps (`--averaging periodic --averaging-every-steps 2`, `--periodic-replicas` of
stage 1) and are judged against that configuration's clean run.

Per run: tokens/s (and the median of the steps' own rates), final loss, the honest replicas' failed
averaging rounds, the peak RSS of the honest peers, of the trainer and of the bootstrap node (VmHWM,
read just before they stop), whether the run finished, the trainer's failures by kind, its calls by
peer, what the attackers' requests got, and the CPU seconds the honest processes and the
attackers' (each process with its p2pd daemons) used while the trainer trained, the attackers'
as a share of the machine's cores: on two cores an attacker's own CPU slows the swarm whatever
the defence does. Goals (issues #30 and #60): tokens/s >= 0.8 of clean,
final loss within 2% of clean, peak RSS < 200 MB above clean on every process.

Attacks (issue #30):
- lying_replica: a stage-1 replica 10x slower than the honest one (`--faults
  slowdown=10,slowdown_mode=device`) that announces 1000x its throughput and reports compute times 1000x
  shorter (`--faults claim_speedup=1000`). Issue #60: under direct routing it drew 239 of 240 chains.
- fake_wrong_stage: `--fakes` stage-1 records announcing 1000x throughput whose peers answer every
  call "wrong stage" (`--faults wrong_stage`).
- outsider_averaging, size_bomb, junk_subkeys, junk_rpcs: the clients of benchmarks/attack_clients.py.
Attacks (issue #60):
- stalling_sybils, stalling_sybils_join: three stage-1 sybils whose compute sleeps 100,000x (they take
  calls and never answer), announcing 1000x the honest speed; there from the start, or joining at
  `--join-at-step`.
- forged_state: a stranger announcing a stage-1 replica of 10^6 steps serves a forged state; an honest
  replica of stage 1 joins at `--join-at-step` (it must load the honest replica's state).
- foreign_record: a stage-0 record of another model fingerprint (before: every new trainer exited).
- commit_bomb: a stranger's commits declaring a group of 4,096 replicas (before, from an allowed
  identity without --run: stage 1's compute froze for 30 s each).
- commit_flood: a stranger's commits of made-up step ids (before: 17 MiB a minute of step ids).
- dht_junk_keys: a raw hivemind node storing 1 kB values under random keys (before: 191 MiB in 14 s).
- probe_streams: probe streams that never finish, re-opened; the client counts its honest echoes.
- periodic_outsider (periodic): a stranger's averager sending 0.5 with weight 1e6.
- weight_1e6 (periodic): the same as a member of the run (a peer credential in its record).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.process_cpu import tree_cpu_s  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from dht.authority import issue, load_owner_key, load_run, write_credential  # noqa: E402
from dht.signing import load_identity, new_identity_file  # noqa: E402
from swarm.local_swarm import LocalSwarm, ManagedProcess, fault_args  # noqa: E402

PEER_ARGS = ["--target-batch-size", "8", "--lr", "3e-3"]  # averaging: the default (sync)
PERIODIC_ARGS = ["--averaging", "periodic", "--averaging-every-steps", "2"]
GOAL_TOKENS_RATIO, GOAL_LOSS_REL, GOAL_RSS_MB = 0.8, 0.02, 200.0
STALL = tuple(fault_args(slowdown=100000.0, slowdown_mode="sleep", claim_speedup=1e8))
SYBILS = 3


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


class Swarm:
    """One run's swarm: the honest processes (the run's owner's) and the honest peers' ids."""

    def __init__(self, local: LocalSwarm, args, replicas: int):
        self.local, self.args = local, args
        self.honest = [local.start_peer(0, name="peer-s0-honest")]
        self.honest += [local.start_peer(1, name=f"peer-s1-honest{i}") for i in range(replicas)]
        local.wait_online(self.honest)
        self.stage0, *self.stage1 = [peer_id_of(p) for p in self.honest]

    def stranger(self, stage: int, *extra: str, name: str) -> ManagedProcess:
        """A peer of the open run without a credential (anyone may serve an open run)."""
        return self.local.start_peer(stage, "--no-load-state", *extra, name=name, stranger=True)

    def credential(self, name: str, role: str, stage: int | None = None) -> tuple[str, str]:
        """An identity file and a credential of the run for it (a member's, issued by the owner)."""
        workdir = self.local.workdir
        key, cred = os.path.join(workdir, f"{name}.key"), os.path.join(workdir, f"{name}.cred")
        new_identity_file(key)
        run = load_run(self.local.run_dir)
        signed = issue(
            load_owner_key(self.local.run_dir, run),
            run,
            role=role,
            peer_id=load_identity(key).peer_id,
            stage=stage,
            valid_for_s=3600,
        )
        write_credential(cred, signed)
        return key, cred

    def client(self, kind: str, *extra: str) -> ManagedProcess:
        """One of benchmarks/attack_clients.py, stopped with the swarm (it is in its process list)."""
        workdir = self.local.workdir
        stats, log_path = os.path.join(workdir, f"{kind}.stats.json"), os.path.join(workdir, f"{kind}.log")
        command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "attack_clients.py")]
        command += [kind, "--initial-peers", *self.local.initial_peers, "--stage0", self.stage0]
        command += ["--stage1", *self.stage1, "--stats", stats, "--pause-s", str(self.args.pause_s), *extra]
        with open(log_path, "w") as log:
            popen = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        process = ManagedProcess(f"attacker-{kind}", popen, log_path)
        self.local.processes.append(process)
        deadline = time.monotonic() + 180
        while not os.path.exists(stats):  # its first round is done: the attack is on
            if not process.alive or time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} client did not complete a round:\n{process.log()[-3000:]}")
            time.sleep(0.5)
        return process


def peer_id_of(process: ManagedProcess) -> str:
    match = re.search(r"peer (\S+) online", process.log())
    if match is None:
        raise RuntimeError(f"{process.name} printed no peer id:\n{process.log()[-2000:]}")
    return match.group(1)


def attacker_stats(swarm: LocalSwarm) -> dict:
    found = {}
    for path in Path(swarm.workdir).glob("*.stats.json"):
        try:
            found[path.name.removesuffix(".stats.json")] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return found


Start = Callable[[Swarm], list[ManagedProcess]]


def nothing(swarm: Swarm) -> list[ManagedProcess]:
    return []


def lying_replica(swarm: Swarm) -> list[ManagedProcess]:
    slow = fault_args(slowdown=10, slowdown_mode="device", claim_speedup=1000)
    return [swarm.stranger(1, *slow, name="peer-s1-liar")]


def fake_wrong_stage(swarm: Swarm) -> list[ManagedProcess]:
    fake = fault_args(wrong_stage=True, claim_speedup=1000)
    return [swarm.stranger(1, *fake, name=f"peer-s1-fake{i}") for i in range(swarm.args.fakes)]


def stalling_sybils(swarm: Swarm) -> list[ManagedProcess]:
    return [swarm.stranger(1, *STALL, name=f"peer-s1-sybil{i}") for i in range(SYBILS)]


def honest_joiner(swarm: Swarm) -> list[ManagedProcess]:
    """An honest replica of stage 1 (the owner's) joining mid-run: it loads a replica's state."""
    return [swarm.local.start_peer(1, name="peer-s1-joiner")]


def client_attack(kind: str, *, role: str | None = None, stage: int | None = None) -> Start:
    """One of attack_clients.py's, a stranger; with `role`, a member holding a credential of the run."""

    def start(swarm: Swarm) -> list[ManagedProcess]:
        extra: list[str] = []
        if role is not None:
            key, cred = swarm.credential(f"attacker-{kind}", role, stage)
            extra = ["--identity-path", key, "--credential", cred]
        swarm.client(kind, *extra)
        return []  # not peers: nothing to wait for

    return start


@dataclass(frozen=True)
class Attack:
    config: str = "sync"  # the configuration whose clean run it is judged against
    before: Start = nothing  # started before the trainer
    during: Start = nothing  # started at --join-at-step


ATTACKS: dict[str, Attack] = {
    "clean": Attack(),
    "lying_replica": Attack(before=lying_replica),
    "fake_wrong_stage": Attack(before=fake_wrong_stage),
    **{
        kind: Attack(before=client_attack(kind))
        for kind in ("outsider_averaging", "size_bomb", "junk_subkeys", "junk_rpcs")
    },
    "stalling_sybils": Attack(before=stalling_sybils),
    "stalling_sybils_join": Attack(during=stalling_sybils),
    "forged_state": Attack(before=client_attack("forged_state"), during=honest_joiner),
    "foreign_record": Attack(before=client_attack("foreign_record")),
    "commit_bomb": Attack(before=client_attack("commit_bomb")),
    "commit_flood": Attack(before=client_attack("commit_flood")),
    "dht_junk_keys": Attack(before=client_attack("dht_junk_keys")),
    "probe_streams": Attack(before=client_attack("probe_streams")),
    "clean_periodic": Attack(config="periodic"),
    "periodic_outsider": Attack(config="periodic", before=client_attack("periodic_outsider")),
    "weight_1e6": Attack(config="periodic", before=client_attack("weight_1e6", role="peer", stage=1)),
}
BASELINES = {"sync": "clean", "periodic": "clean_periodic"}


def one_run(name: str, args, workdir: str) -> dict:
    attack = ATTACKS[name]
    periodic = attack.config == "periodic"
    report_path = os.path.join(workdir, "report.json")
    os.makedirs(workdir, exist_ok=True)
    peer_args = PEER_ARGS + (PERIODIC_ARGS if periodic else [])
    with LocalSwarm(workdir=workdir, model="tiny", num_stages=2, peer_args=peer_args) as local:
        local.start_bootstrap()
        bootstrap = local.processes[0]
        swarm = Swarm(local, args, args.periodic_replicas if periodic else args.replicas)
        attackers = attack.before(swarm)
        if attackers:
            local.wait_online(attackers, timeout_s=300)
        started = time.monotonic()
        trainer = local.start_trainer(
            *("--steps", str(args.steps), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"),
            *("--refresh-period-s", "2", "--seed", "3", "--report", report_path),
        )
        peak = {"trainer": 0.0, "bootstrap": 0.0}
        cpu_before = {id(p): tree_cpu_s(p.popen.pid) for p in local.processes}
        joined: list[ManagedProcess] = []
        deadline = started + args.timeout_s
        while trainer.alive and time.monotonic() < deadline:
            peak["trainer"] = max(peak["trainer"], peak_rss_mb(trainer) or 0.0)
            peak["bootstrap"] = max(peak["bootstrap"], peak_rss_mb(bootstrap) or 0.0)
            if attack.during is not nothing and not joined and f"step {args.join_at_step:>4}/" in trainer.log():
                joined = attack.during(swarm) or [None]
            time.sleep(0.5)
        finished = trainer.popen.poll() == 0
        # CPU over the training window, by who: the honest processes (peers, trainer, bootstrap) and
        # the attackers (everything else the run started: strangers, clients, fakes, joiners)
        train_s = time.monotonic() - started
        honest_ids = {id(p) for p in [*swarm.honest, trainer, bootstrap]}
        cpu_s = {"honest": 0.0, "attackers": 0.0}
        for p in local.processes:
            used = tree_cpu_s(p.popen.pid) - cpu_before.get(id(p), 0.0)
            cpu_s["honest" if id(p) in honest_ids else "attackers"] += max(used, 0.0)
        peers_rss = max((peak_rss_mb(p) or 0.0) for p in swarm.honest)
        honest_alive = all(p.alive for p in swarm.honest)
        stats = attacker_stats(local)
        # a sync round that failed (at its 30 s deadline, or no group found) stalls the step: it happens in
        # clean runs too on a loaded machine, and one in a short run halves its tokens/s
        failed_rounds = sum(p.log().count("no averaging round with the other replicas") for p in swarm.honest)
        loaded = [
            re.findall(r"loaded stage \d state from replica (\S+) \((\d+) steps done", p.log())
            for p in joined
            if p is not None
        ]
        try:
            report = json.loads(open(report_path).read())
        except (OSError, ValueError):
            report = {}
    return {
        "attack": name,
        "config": attack.config,
        "finished": finished and bool(report.get("completed")),
        "honest_peers_alive": honest_alive,
        "wall_s": round(time.monotonic() - started, 1),
        "tokens_per_s": report.get("tokens_per_s"),
        "median_step_tokens_per_s": statistics.median(report["tokens_per_s_by_step"])
        if report.get("tokens_per_s_by_step")
        else None,
        "final_loss": report.get("final_loss"),
        "honest_failed_averaging_rounds": failed_rounds,
        "peak_peer_rss_mb": round(peers_rss, 1),
        "peak_trainer_rss_mb": round(peak["trainer"], 1),
        "peak_bootstrap_rss_mb": round(peak["bootstrap"], 1),
        "failures_by_kind": report.get("failures_by_kind", {}),
        "calls_by_peer": report.get("calls_by_peer", {}),
        "microbatches_hub_timed": report.get("microbatches_hub_timed"),
        "foreign_peers_skipped": report.get("foreign_peers_skipped"),
        "banned": {p[-8:]: c.get("banned") for p, c in report.get("contributions", {}).items() if c.get("banned")},
        "joiners_loaded_from": loaded,
        "attackers": stats,
        "honest_cpu_s": round(cpu_s["honest"], 1),
        "attacker_cpu_s": round(cpu_s["attackers"], 1),
        "attacker_cpu_share": round(cpu_s["attackers"] / (train_s * (os.cpu_count() or 1)), 3),
    }


def judge(run: dict, clean: dict) -> dict:
    """Each goal of issues #30 and #60, against the clean run of the same configuration."""
    if not (run["finished"] and clean["finished"]):
        return {"meets_goals": False}
    ratio = run["tokens_per_s"] / clean["tokens_per_s"]
    loss_rel = abs(run["final_loss"] - clean["final_loss"]) / clean["final_loss"]
    rss_over = max(run[f"peak_{who}_rss_mb"] - clean[f"peak_{who}_rss_mb"] for who in ("peer", "trainer", "bootstrap"))
    return {
        "tokens_ratio": round(ratio, 3),
        "median_step_ratio": round(run["median_step_tokens_per_s"] / clean["median_step_tokens_per_s"], 3),
        "loss_rel_diff": round(loss_rel, 4),
        "rss_over_clean_mb": round(rss_over, 1),
        "meets_goals": ratio >= GOAL_TOKENS_RATIO and loss_rel <= GOAL_LOSS_REL and rss_over < GOAL_RSS_MB,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    attacks = [a for a in ATTACKS if a not in BASELINES.values()]
    parser.add_argument("--attacks", nargs="+", default=attacks, choices=attacks)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fakes", type=int, default=9, help="fake wrong-stage records (peers)")
    parser.add_argument("--replicas", type=int, default=2, help="honest replicas of stage 1 (they average)")
    parser.add_argument("--periodic-replicas", type=int, default=3, help="... in the periodic rows")
    parser.add_argument("--join-at-step", type=int, default=5, help="when a row's `during` attack starts")
    parser.add_argument("--pause-s", type=float, default=0.2, help="attack clients' pause between rounds")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--out", default="benchmarks/out/attacks.json")
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="run in DIR and keep every run's logs (default: a temporary folder)"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    configs = {ATTACKS[a].config for a in args.attacks}
    names = [BASELINES[c] for c in BASELINES if c in configs] + args.attacks
    runs = {}
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)
    with (
        contextlib.nullcontext(args.keep_logs)
        if args.keep_logs
        else tempfile.TemporaryDirectory(prefix="swarm-attacks-") as root
    ):
        for name in names:
            try:
                run = one_run(name, args, os.path.join(root, name))
            except Exception as e:  # an attack that could not be set up: say so, go on with the next
                run = {"attack": name, "config": ATTACKS[name].config, "finished": False}
                run["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
            print(json.dumps(run), flush=True)
            runs[name] = run
    for name in args.attacks:
        runs[name].update(judge(runs[name], runs[BASELINES[ATTACKS[name].config]]))
    write_report(
        args.out,
        {
            "command": " ".join(sys.argv),
            "steps": args.steps,
            "fakes": args.fakes,
            "replicas": args.replicas,
            "periodic_replicas": args.periodic_replicas,
            "join_at_step": args.join_at_step,
            "pause_s": args.pause_s,
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "runs": list(runs.values()),
        },
    )
    return 0 if all(runs[a].get("meets_goals", False) for a in args.attacks) else 1


if __name__ == "__main__":
    sys.exit(main())
