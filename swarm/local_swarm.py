"""A whole swarm on this machine, as real processes: a bootstrap DHT node and peers, each in its
own process group so that stopping one also stops its DHT process and p2pd. Used by `swarm demo`,
the integration tests and the benchmarks, so they all exercise the same commands a user runs.

Safe by default (SECURITY.md): a local swarm is an open run with an authority, made as `swarm run
create` makes one (`<workdir>/run`, the owner key inside). Every peer and trainer it starts is the
owner's, given `--run` that folder, and issues itself a credential (dht/authority.py); a process
started as a `stranger` knows only the run's public file (it may serve an open run, never train,
average or download state). `run=False` starts a swarm with no authority, as before issue #60.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dht.authority import RUN_FILE, create_run, issue, load_owner_key, load_run
from peers.compute.faults import FaultSettings
from process.config import packed_text
from process.fork_server import ForkServer
from process.lifetime import die_with_parent, kill_leftovers, process_tree, start_time

# What a swarm's processes import, imported once by a fork server for all of them (torch's
# optimizers import torch._dynamo on their first step).
SWARM_MODULES = (
    "torch._dynamo",
    "peers.launch",
    "swarm.data.prepare",
    "swarm.evaluate",
    "swarm.export.run",
    "swarm.generate",
    "swarm.status",
    "swarm.trainer.run",
)


class LocalSwarmError(RuntimeError):
    pass


def fault_args(**faults) -> list[str]:
    """The peer flags that inject `faults` (peers/compute/faults.py's FaultSettings fields without
    `fault_`, e.g. slowdown=3, slowdown_mode="busy"): the peer's one developer option, `--faults`."""
    settings = FaultSettings(**{f"fault_{name}": value for name, value in faults.items()})
    return ["--faults", packed_text(settings, prefix="fault_")]


def start_fork_server() -> ForkServer:
    """A fork server for `swarm` processes (process/fork_server.py), importing as it starts: its
    `launch` is a LocalSwarm's `launcher`. Close it once the swarm has stopped."""
    return ForkServer.start(entry="swarm.cli:run_forked", preload=SWARM_MODULES)


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen  # or what a `launcher` returns: the same pid, poll, wait, returncode, send_signal
    log_path: str
    terminated: bool = False  # SIGTERM sent: a second one would stop it at once, skipping its orderly stop

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def tree(self) -> list[tuple[int, int | None]]:
        """(pid, start time) of the process and of every descendant now (its DHT process, p2pd)."""
        return [(pid, start_time(pid)) for pid in process_tree(self.popen.pid)] if self.alive else []

    def terminate(self) -> None:
        """SIGTERM the process itself, once: it then stops in order (a second signal stops it at once)."""
        if self.alive and not self.terminated:
            self.terminated = True
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process itself (a peer then announces offline through its DHT process, so
        that one must not be signalled too), then SIGKILL whatever is left of its group and of
        its process tree (children run in groups of their own and die with their parent; this
        is the belt to those braces)."""
        tree = self.tree()
        if self.alive:
            self.terminate()
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # also reaps children (p2pd) that outlived their parent
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        kill_leftovers(tree[1:])


@dataclass
class LocalSwarm:
    model: str = "small"
    num_stages: int = 2
    workdir: str | None = None
    peer_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    processes: list[ManagedProcess] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)
    # launcher(args, env, log_path): starts `swarm.cli` with args another way than a new interpreter
    # (`start_fork_server().launch` forks a process that has imported the project);
    # processes started under a `prefix` (a network namespace, a profiler) always get their own
    launcher: Callable[[list[str], dict[str, str], str], subprocess.Popen] | None = None
    run: bool = True  # an open run with an authority, whose owner starts every process (module docstring)

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="swarm-")
        os.makedirs(self.workdir, exist_ok=True)
        self.run_dir = self.public_run = None
        if self.run:
            self.run_dir = os.path.join(self.workdir, "run")
            if not os.path.exists(os.path.join(self.run_dir, RUN_FILE)):  # a reused workdir keeps its run
                create_run(self.run_dir, private=False)
            public = os.path.join(self.workdir, "public-run")
            os.makedirs(public, exist_ok=True)
            shutil.copyfile(os.path.join(self.run_dir, RUN_FILE), os.path.join(public, RUN_FILE))
            self.public_run = os.path.join(public, RUN_FILE)

    def issue_credential(self, peer_id: str, role: str = "trainer", stage: int | None = None) -> str:
        """A credential of this swarm's run for `peer_id`, as the owner would issue it (for a test's
        or a benchmark's own client)."""
        if self.run_dir is None:
            raise LocalSwarmError("this swarm has no run (run=False)")
        run = load_run(self.run_dir)
        owner = load_owner_key(self.run_dir, run)
        return issue(owner, run, role=role, peer_id=peer_id, stage=stage, valid_for_s=86400.0).to_bytes().decode()

    def run_args(self, *args: str, stranger: bool = False) -> list[str]:
        """The run flags of a process of this swarm: the owner's folder (the process issues itself a
        credential), or for a `stranger` the run's public file alone; none when `args` name a run of
        their own (`--run`, `--credential`) or the swarm has none."""
        if self.run_dir is None or "--run" in args or "--credential" in args:
            return []
        return ["--run", self.public_run if stranger else self.run_dir]

    # --- processes ---------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], prefix: list[str] = ()) -> ManagedProcess:
        """prefix: a command that runs the rest (e.g. `ip netns exec NS` to start it in a namespace)."""
        log_path = os.path.join(self.workdir, f"{name}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.launcher is not None and not prefix:
            popen = self.launcher(args, env, log_path)
        else:
            with open(log_path, "w") as log:
                popen = subprocess.Popen(
                    [*prefix, sys.executable, "-m", "swarm.cli", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    preexec_fn=die_with_parent(),  # stops, keeping what matters, when we die, however we die
                )
        process = ManagedProcess(name, popen, log_path)
        self.processes.append(process)
        return process

    def start_bootstrap(self, timeout_s: float = 60.0, *extra_args: str, prefix: list[str] = ()) -> list[str]:
        maddrs_file = os.path.join(self.workdir, "bootstrap.maddrs")
        if os.path.exists(maddrs_file):  # a reused workdir: the address of a bootstrap node long gone
            os.remove(maddrs_file)
        # the bootstrap guards this model's keys too (dht/record_policy.py)
        args = ["dht", "--maddrs-file", maddrs_file, "--models", self.model, *extra_args]
        process = self._spawn("bootstrap", args, prefix)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(maddrs_file):
            if not process.alive:
                raise LocalSwarmError(f"the bootstrap node exited:\n{process.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise LocalSwarmError(
                    f"the bootstrap node did not start within {timeout_s} s; its log ends:\n{process.log()[-2000:]}"
                )
            time.sleep(0.1)
        with open(maddrs_file) as f:
            self.initial_peers = [line.strip() for line in f if line.strip()]
        return self.initial_peers

    def start_peer(
        self, stage: int, *extra_args: str, name: str | None = None, prefix: list[str] = (), stranger: bool = False
    ) -> ManagedProcess:
        """A peer of `stage`: the run's owner's (a member), or a `stranger`'s (no credential)."""
        if not self.initial_peers:
            raise LocalSwarmError("start the bootstrap node first")
        name = name or f"peer-s{stage}-{sum(p.name.startswith(f'peer-s{stage}-') for p in self.processes)}"
        args = [
            "peer",
            "--initial-peers",
            *self.initial_peers,
            "--model",
            self.model,
            "--stage",
            str(stage),
            "--num-stages",
            str(self.num_stages),
            *self.peer_args,
            *self.run_args(*self.peer_args, *extra_args, stranger=stranger),
            *extra_args,
        ]
        return self._spawn(name, args, prefix)

    def start_volunteer(self, *args: str, name: str | None = None) -> ManagedProcess:
        """A peer started as a volunteer starts one: `--initial-peers` and `args`, the run's spec says the rest."""
        name = name or f"peer-v{sum(p.name.startswith('peer-v') for p in self.processes)}"
        return self._spawn(name, ["peer", "--initial-peers", *self.initial_peers, *args])

    def wait_online(self, processes: list[ManagedProcess], timeout_s: float = 120.0) -> None:
        """Wait until each peer printed that it is online (its first announcement follows at once)."""
        deadline = time.monotonic() + timeout_s
        pending = list(processes)
        while pending:
            for process in list(pending):
                if " online:" in process.log():
                    pending.remove(process)
                elif not process.alive:
                    raise LocalSwarmError(f"{process.name} exited before coming online:\n{process.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise LocalSwarmError(f"{[p.name for p in pending]} not online within {timeout_s} s")
            time.sleep(0.2)

    def start_trainer(
        self, *args: str, name: str = "trainer", prefix: list[str] = (), stranger: bool = False, named: bool = True
    ) -> ManagedProcess:
        """A trainer: the run's owner's, or a `stranger`'s (its training calls are refused);
        `named=False`: without --model (the run's spec names it)."""
        run = self.run_args(*args, stranger=stranger)
        model = ["--model", self.model] if named else []
        return self._spawn(name, ["train", "--initial-peers", *self.initial_peers, *model, *run, *args], prefix)

    def start_monitor(self, *args: str, name: str = "monitor") -> ManagedProcess:
        """`swarm monitor targets` on this swarm's DHT (pass --out FILE and any other flags)."""
        return self._spawn(
            name, ["monitor", "targets", "--initial-peers", *self.initial_peers, "--model", self.model, *args]
        )

    def peers(self) -> list[ManagedProcess]:
        return [p for p in self.processes if p.name.startswith("peer-")]

    def stop(self) -> None:
        """Stop everything in order: trainers and tools first (a trainer's last step and commit still
        reach the peers), then the peers together (each saves, then announces offline), the bootstrap
        node last."""
        phases = [
            [p for p in self.processes if not p.name.startswith("peer-") and p.name != "bootstrap"],
            [p for p in self.processes if p.name.startswith("peer-")],
            [p for p in self.processes if p.name == "bootstrap"],
        ]
        for phase in phases:
            for process in phase:
                process.terminate()
            for process in phase:
                process.stop()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
