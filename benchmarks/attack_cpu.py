"""Where the honest processes' CPU goes under one of attacks.py's client attacks, with no trainer.

    .venv/bin/python benchmarks/attack_cpu.py --attack dht_junk_keys --out benchmarks/out/attack_cpu.json

The swarm of benchmarks/attacks.py (the bootstrap, one peer of stage 0, `--replicas` of stage 1, on
loopback) stands idle for `--seconds`, then the attack's client (benchmarks/attack_clients.py)
runs for as long. For each honest process the CPU (user + system) of each stretch is split into the
process itself, its Python helpers (hivemind's DHT process) and its libp2p daemons (p2pd); the
attacker's own CPU is read the same way, and its client's counts are kept. With `--profile DIR`,
py-spy samples each honest Python process during the attack (raw stacks in DIR, and each one's most
frequent frames in the JSON; py-spy must be installed). Attacks that act through a trainer's calls
or averaging rounds cost nothing here: this is for floods of the DHT and the RPCs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.attacks import ATTACKS, PEER_ARGS, Swarm  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from swarm.local_swarm import LocalSwarm, ManagedProcess  # noqa: E402

CLIENT_ATTACKS = ("dht_junk_keys", "junk_rpcs", "size_bomb", "junk_subkeys", "commit_flood", "probe_streams")
IDLE_FRAMES = ("select", "epoll", "poll", "wait", "sleep", "_wait_for_tstate_lock")


def cpu_by_part(process: ManagedProcess) -> dict[int, tuple[str, float]]:
    """pid -> (part, CPU seconds so far) over a process's tree: 'main', 'helper' (Python) or 'p2pd'."""
    try:
        root = psutil.Process(process.popen.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    parts = {}
    for member in tree:
        try:
            times = member.cpu_times()
            part = "p2pd" if member.name() == "p2pd" else ("main" if member.pid == root.pid else "helper")
            parts[member.pid] = (part, times.user + times.system)
        except psutil.Error:
            continue
    return parts


def spent(processes: list[ManagedProcess], seconds: float) -> dict[str, dict[str, float]]:
    """CPU seconds each process's parts took over the next `seconds`."""
    before = {p.name: cpu_by_part(p) for p in processes}
    time.sleep(seconds)
    result = {}
    for process in processes:
        totals: dict[str, float] = {"main": 0.0, "helper": 0.0, "p2pd": 0.0}
        for pid, (part, cpu) in cpu_by_part(process).items():
            earlier = before[process.name].get(pid)
            totals[part] += cpu - (earlier[1] if earlier else 0.0)
        result[process.name] = {part: round(cpu, 3) for part, cpu in totals.items()}
    return result


def python_pids(processes: list[ManagedProcess]) -> list[tuple[str, int]]:
    pids = []
    for process in processes:
        for pid, (part, _) in cpu_by_part(process).items():
            if part != "p2pd":
                pids.append((f"{process.name}-{part}-{pid}", pid))
    return pids


def top_frames(path: str, count: int = 15, root_share: float = 0.8) -> dict:
    """The frames most often on an active stack (idle waits left out) of a py-spy raw file, but those
    on at least `root_share` of them (the process's start-up chain, under everything it does)."""
    inclusive: collections.Counter = collections.Counter()
    active = 0
    with open(path) as f:
        for line in f:
            stack, _, samples = line.rstrip().rpartition(" ")
            if not stack or not samples.isdigit():
                continue
            frames = stack.split(";")
            if any(word in frames[-1].split(" (")[0] for word in IDLE_FRAMES):
                continue
            active += int(samples)
            for frame in set(frames):
                inclusive[frame] += int(samples)
    return {
        "active_samples": active,
        "frames": [[round(n / active, 3), frame] for frame, n in inclusive.most_common() if n < root_share * active][
            :count
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attack", default="dht_junk_keys", choices=CLIENT_ATTACKS)
    parser.add_argument("--seconds", type=float, default=30.0, help="each stretch: idle, then attacked")
    parser.add_argument("--replicas", type=int, default=2, help="honest replicas of stage 1")
    parser.add_argument("--pause-s", type=float, default=0.2, help="the attack client's pause between rounds")
    parser.add_argument("--profile", default=None, metavar="DIR", help="py-spy each honest Python process into DIR")
    parser.add_argument("--out", default="benchmarks/out/attack_cpu.json")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if args.profile and py_spy is None:
        sys.exit("--profile needs py-spy: .venv/bin/pip install py-spy")
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="swarm-attack-cpu-") as workdir:
        with LocalSwarm(workdir=workdir, model="tiny", num_stages=2, peer_args=PEER_ARGS) as local:
            local.start_bootstrap()
            swarm = Swarm(local, args, args.replicas)
            honest = [local.processes[0], *swarm.honest]
            time.sleep(5.0)  # the peers' first announcements and DHT refreshes
            print(f"idle for {args.seconds:.0f} s", flush=True)
            idle = spent(honest, args.seconds)
            ATTACKS[args.attack].before(swarm)
            attacker = local.processes[-1]
            print(f"under {args.attack} for {args.seconds:.0f} s", flush=True)
            profilers = []
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                for name, pid in python_pids(honest):
                    path = os.path.join(args.profile, f"{args.attack}-{name}.txt")
                    command = [py_spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds))]
                    command += ["--rate", "50", "--format", "raw", "--nonblocking", "--output", path]
                    profilers.append(
                        (name, path, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    )
            attacker_before = sum(cpu for _, cpu in cpu_by_part(attacker).values())
            attacked = spent(honest, args.seconds)
            attacker_s = sum(cpu for _, cpu in cpu_by_part(attacker).values()) - attacker_before
            profiles = {}
            for name, path, popen in profilers:
                popen.wait(timeout=60)
                if os.path.exists(path):
                    profiles[name] = top_frames(path)
            stats_path = os.path.join(workdir, f"{args.attack}.stats.json")
            with open(stats_path) as f:
                outcomes = json.load(f)
    honest_attacked = sum(sum(parts.values()) for parts in attacked.values())
    honest_idle = sum(sum(parts.values()) for parts in idle.values())
    by_part = {
        part: round(sum(p[part] for p in attacked.values()) - sum(p[part] for p in idle.values()), 3)
        for part in ("main", "helper", "p2pd")
    }
    summary = {
        "honest_cpu_s_idle": round(honest_idle, 3),
        "honest_cpu_s_attacked": round(honest_attacked, 3),
        "honest_cpu_s_added_by_part": by_part,
        "attacker_cpu_s": round(attacker_s, 3),
        "honest_added_per_attacker_cpu_s": round((honest_attacked - honest_idle) / attacker_s, 3)
        if attacker_s
        else None,
        # the honest CPU added per thing the attacker's client counted (e.g. per junk value sent), ms
        "honest_added_ms_per_outcome": {
            what: round(1000 * (honest_attacked - honest_idle) / count, 3)
            for what, count in outcomes.get("outcomes", {}).items()
            if count
        },
    }
    print(json.dumps(summary, indent=1))
    write_report(
        args.out,
        {
            "args": vars(args),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "idle": idle,
            "attacked": attacked,
            "summary": summary,
            "attacker_outcomes": outcomes,
            "profiles": profiles,
        },
    )


if __name__ == "__main__":
    main()
