"""What a small local swarm costs to start and stop, as the integration tests start one: a bootstrap
node, three `tiny` peers (two replicas of stage 0 with sync averaging, one of stage 1), a trainer
that takes one step, then every process stopped. Each phase's wall time, and the CPU the swarm's
processes spent, by kind (the p2pd daemons, torch_shm_manager, the Python processes: peers, trainer,
DHT nodes and averagers).

    .venv/bin/python benchmarks/swarm_start_stop.py --cycles 4 --out benchmarks/out/swarm_start_stop.json

`--sharing` names the memory-sharing strategies of hivemind's processes to compare
(HIVEMIND_MEMORY_SHARING_STRATEGY; the project's default is `file_descriptor`, hivemind's own is
`file_system`). Each strategy gets its own fork server (process/fork_server.py, as the tests and
`swarm demo` use), started once, and the cycles alternate between them so that a change in the
machine's load falls on both. CPU is read from /proc every 0.1 s for every descendant of the fork
servers, so a process's last tenth of a second may be missed.

`--killed N` adds N cycles per strategy in which every process (with its DHT process, p2pd and
averager) is SIGKILLed after the trainer's step instead of stopped, and counts what that left in
/tmp (`pymp-*` folders, hivemind's sockets, `torch-shm-dir-*` folders) and in /dev/shm. Nothing else
may run on the machine meanwhile: the counts are of the whole folders.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from process.fork_server import ForkServer  # noqa: E402
from swarm.local_swarm import LocalSwarm, start_fork_server  # noqa: E402

PHASES = ("bootstrap", "peers_online", "trainer", "stop")


class CpuByKind:
    """The CPU seconds of every process below `root`, sampled until `stop`, summed by kind."""

    def __init__(self, root: int):
        self.root, self.last = psutil.Process(root), {}
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            try:
                children = self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for process in children:
                try:
                    with process.oneshot():
                        times, name = process.cpu_times(), process.name()
                except psutil.Error:
                    continue
                self.last[(process.pid, process.create_time())] = (name, times.user + times.system)
            time.sleep(0.1)

    def stop(self) -> dict[str, float]:
        self.running = False
        self.thread.join()
        split = {"p2pd": 0.0, "torch_shm_manager": 0.0, "python": 0.0}
        for name, cpu in self.last.values():
            kind = "p2pd" if name == "p2pd" else "torch_shm_manager" if name.startswith("torch_shm") else "python"
            split[kind] += cpu
        return {kind: round(cpu, 2) for kind, cpu in split.items()}


def small_swarm(server: ForkServer, model: str, workdir: str) -> LocalSwarm:
    """The swarm of a cycle, not started: 2 stages, sync averaging, processes forked by `server`."""
    return LocalSwarm(
        model=model, num_stages=2, workdir=workdir, launcher=server.launch, peer_args=["--averaging", "sync"]
    )


def start_peers(swarm: LocalSwarm) -> None:
    """Two replicas of stage 0 and one of stage 1, online."""
    swarm.wait_online([swarm.start_peer(stage) for stage in (0, 0, 1)])


def train_one_step(swarm: LocalSwarm) -> None:
    trainer = swarm.start_trainer("--num-stages", "2", "--steps", "1", "--batch-size", "8", "--microbatch-size", "2")
    if trainer.popen.wait(timeout=300) != 0:
        raise RuntimeError(f"the trainer failed:\n{trainer.log()[-2000:]}")


def one_cycle(server: ForkServer, model: str, workdir: str) -> dict:
    cpu = CpuByKind(server.popen.pid)
    times, started = {}, time.monotonic()
    swarm = small_swarm(server, model, workdir)
    try:
        swarm.start_bootstrap()
        times["bootstrap"] = time.monotonic() - started
        start_peers(swarm)
        times["peers_online"] = time.monotonic() - started - sum(times.values())
        train_one_step(swarm)
        times["trainer"] = time.monotonic() - started - sum(times.values())
    finally:
        swarm.stop()
    times["stop"] = time.monotonic() - started - sum(times.values())
    cycle = {phase: round(seconds, 2) for phase, seconds in times.items()}
    cycle["total"] = round(time.monotonic() - started, 2)
    cycle["cpu_s"] = cpu.stop()
    return cycle


def leftovers() -> dict[str, int]:
    """What killed processes leave behind, counted over the whole machine."""
    return {
        "pymp_folders": len(glob.glob("/tmp/pymp-*")),
        "hivemind_sockets": len(glob.glob("/tmp/hivemind-*.sock")),
        "torch_shm_folders": len(glob.glob("/tmp/torch-shm-dir-*")),
        "dev_shm_files": len(os.listdir("/dev/shm")),
    }


def killed_cycle(server: ForkServer, model: str, workdir: str) -> dict[str, int]:
    """A swarm whose every process tree is SIGKILLed after one step: what it leaves behind."""
    before = leftovers()
    swarm = small_swarm(server, model, workdir)
    try:
        swarm.start_bootstrap()
        start_peers(swarm)
        train_one_step(swarm)
        trees = [pid for process in swarm.processes for pid, _ in process.tree()]
        for pid in trees:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(3)  # a manager whose clients are gone would clean up within about 2 s
    finally:
        swarm.stop()
    after = leftovers()
    return {kind: after[kind] - before[kind] for kind in after}


def start_server(strategy: str) -> ForkServer:
    """A fork server whose processes share memory by `strategy` (its imports read it once)."""
    before = os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY")
    os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"] = strategy
    try:
        server = start_fork_server()
    finally:
        if before is None:
            del os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"]
        else:
            os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"] = before
    server.wait_ready()
    return server


def summary(cycles: list[dict]) -> dict:
    medians = {key: round(statistics.median(c[key] for c in cycles), 2) for key in (*PHASES, "total")}
    medians["cpu_s"] = {
        kind: round(statistics.median(c["cpu_s"][kind] for c in cycles), 2) for kind in cycles[0]["cpu_s"]
    }
    medians["cpu_s"]["all"] = round(statistics.median(sum(c["cpu_s"].values()) for c in cycles), 2)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=4, help="start-stop cycles per strategy")
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--sharing", nargs="+", default=["file_system", "file_descriptor"], help="memory-sharing strategies"
    )
    parser.add_argument("--killed", type=int, default=0, help="also N cycles per strategy ended by SIGKILL")
    parser.add_argument("--out", default="benchmarks/out/swarm_start_stop.json")
    parser.add_argument("--keep-logs", action="store_true", help="keep the swarms' logs (kept anyway on a failure)")
    args = parser.parse_args()
    load_before, workdir = os.getloadavg(), tempfile.mkdtemp(prefix="start-stop-")
    servers = {strategy: start_server(strategy) for strategy in args.sharing}
    cycles: dict[str, list[dict]] = {strategy: [] for strategy in args.sharing}
    killed: dict[str, list[dict]] = {strategy: [] for strategy in args.sharing}
    finished = False
    try:
        one_cycle(servers[args.sharing[0]], args.model, os.path.join(workdir, "warmup"))  # caches, page cache
        for index in range(args.cycles):
            for strategy in args.sharing if index % 2 == 0 else reversed(args.sharing):
                cycle = one_cycle(servers[strategy], args.model, os.path.join(workdir, f"{strategy}-{index}"))
                cycles[strategy].append(cycle)
                print(f"{strategy:16s} cycle {index}: {cycle}", flush=True)
        time.sleep(3)  # the stopped cycles' managers exit about 2 s after their clients, cleaning up
        for index in range(args.killed):
            for strategy in args.sharing:
                left = killed_cycle(servers[strategy], args.model, os.path.join(workdir, f"killed-{strategy}-{index}"))
                killed[strategy].append(left)
                print(f"{strategy:16s} killed {index}: left {left}", flush=True)
        finished = True
    finally:
        for server in servers.values():
            server.close()
        if finished and not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"the swarms' logs are in {workdir}", flush=True)
    report = {
        "benchmark": "swarm_start_stop",
        "model": args.model,
        "cycles": args.cycles,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "strategies": {
            strategy: {"median": summary(runs) if runs else None, "cycles": runs, "killed_left": killed[strategy]}
            for strategy, runs in cycles.items()
        },
    }
    for strategy, runs in cycles.items():
        if runs:
            print(f"{strategy:16s} median: {summary(runs)}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
