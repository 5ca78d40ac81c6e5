"""Every role ends whole: SIGTERM stops it in order, SIGKILL of its main process alone still ends
its DHT process and p2pd (they die with their parent), and nothing of its process tree is left
10 s later. The tree is collected before the signal and checked by pid (psutil tells a pid reused
by another process from the one we saw), never by process name."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from dht.announce import fetch_stage_records
from dht.node import NetworkConfig, start_dht
from dht.records import PeerState
from process.lifetime import die_with_parent
from tests.integration.polling import trainer_step, wait_for

pytestmark = pytest.mark.slow

GONE_WITHIN_S = 10.0
STOP_SIGNALS = [signal.SIGTERM, signal.SIGKILL]


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def running(tree: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in tree:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def bound_sockets(tree: list[psutil.Process]) -> set[str]:
    """The paths of the unix sockets the tree's processes listen on: p2pd's, each process's p2p
    client's, torch's shared-memory manager's (in its folder). An orderly stop removes every one."""
    paths = set()
    for process in tree:
        try:
            connections = process.net_connections(kind="unix")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        paths.update(c.laddr for c in connections if c.laddr.startswith("/"))
    return paths


def signal_main_and_wait(
    popen: subprocess.Popen, sig: int, *, least: int, within_s: float = GONE_WITHIN_S
) -> list[psutil.Process]:
    """Signal the main pid only; assert its whole tree (at least `least` processes, so that the DHT
    process and p2pd are in it) is gone within `within_s`."""
    tree = process_tree(popen.pid)
    assert len(tree) >= least, [p.cmdline()[:3] for p in tree]
    os.kill(popen.pid, sig)
    try:
        popen.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        pass
    wait_for(lambda: not running(tree), within_s, f"no process of the tree left after {sig.name}")
    return tree


@pytest.fixture(scope="module")
def swarm(module_swarm):
    """A bootstrap node and one peer serving the whole tiny model (a 1-stage pipeline)."""
    swarm = module_swarm(num_stages=1, peer_args=["--averaging", "none", "--reachability-check", "off"])
    swarm.start_bootstrap()
    server = swarm.start_peer(0, name="peer-server")
    swarm.wait_online([server])
    return swarm


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_dht_node_ends_whole(make_swarm, sig):
    swarm = make_swarm(num_stages=1)
    swarm.start_bootstrap()
    node = swarm.processes[0]
    signal_main_and_wait(node.popen, sig, least=3)
    if sig == signal.SIGTERM:
        assert "DHT bootstrap node stopped" in node.log()
    assert not glob.glob(os.path.join(swarm.workdir, "*.tmp.*"))


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_peer_ends_whole(swarm, tmp_path, sig):
    checkpoints = tmp_path / "ckpt"
    peer = swarm.start_peer(0, "--checkpoint-dir", str(checkpoints), name=f"peer-{sig.name}")
    swarm.wait_online([peer])
    peer_id = peer.log().split("peer ", 1)[1].split(" ", 1)[0]
    signal_main_and_wait(peer.popen, sig, least=3)
    assert not glob.glob(str(checkpoints / "*.tmp.*"))
    if sig != signal.SIGTERM:
        return
    log = peer.log()
    assert glob.glob(str(checkpoints / "*.ckpt")), log
    assert log.index("checkpoint saved") < log.index("offline after"), log  # the checkpoint first
    assert "Traceback" not in log, log
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
    try:
        records = {r.peer_id: r for r in fetch_stage_records(dht, "tiny", 0)}
    finally:
        dht.shutdown()
    assert peer_id in records and records[peer_id].state == PeerState.OFFLINE, records


def test_a_peer_stopped_with_its_process_group_still_saves_and_says_offline(swarm, tmp_path):
    """A supervisor's stop (SIGTERM to the whole group) reaches only the peer's main process: its DHT
    process and p2pd live in groups of their own, so the checkpoint and the offline record do not
    wait on a daemon that died first."""
    checkpoints = tmp_path / "ckpt"
    peer = swarm.start_peer(0, "--checkpoint-dir", str(checkpoints), name="peer-group")
    swarm.wait_online([peer])
    tree = process_tree(peer.popen.pid)
    os.killpg(peer.popen.pid, signal.SIGTERM)
    peer.popen.wait(timeout=GONE_WITHIN_S)
    wait_for(lambda: not running(tree), GONE_WITHIN_S, "no process of the tree left")
    log = peer.log()
    assert glob.glob(str(checkpoints / "*.ckpt")) and not glob.glob(str(checkpoints / "*.tmp.*")), log
    assert "offline after" in log and "Traceback" not in log and "timed out" not in log, log


def test_a_peer_whose_parent_is_killed_saves_its_checkpoint_and_ends_whole(swarm, tmp_path):
    """The peer of a killed demo (or LocalSwarm) gets the parent-death signal: it saves its checkpoint
    and stops without the DHT goodbyes (the swarm goes down with its parent), its tree within 10 s."""
    checkpoints, log_path = tmp_path / "ckpt", tmp_path / "parent.log"
    parent_code = (
        "import sys, time\n"
        "from swarm.local_swarm import LocalSwarm\n"
        "s = LocalSwarm(model='tiny', num_stages=1, workdir=sys.argv[1], peer_args=sys.argv[3:])\n"
        "s.initial_peers = sys.argv[2].split(',')\n"
        "s.start_peer(0, name='peer-orphan')\n"
        "time.sleep(600)\n"
    )
    peer_args = [*swarm.peer_args, "--checkpoint-dir", str(checkpoints)]
    with open(log_path, "w") as log:
        parent = subprocess.Popen(
            [sys.executable, "-c", parent_code, str(tmp_path), ",".join(swarm.initial_peers), *peer_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    peer_log, tree = tmp_path / "peer-orphan.log", process_tree(parent.pid)
    try:
        wait_for(lambda: peer_log.exists() and " online:" in peer_log.read_text(), 120, "the peer to come online")
        tree = process_tree(parent.pid)
        signal_main_and_wait(parent, signal.SIGKILL, least=4)  # the parent, the peer, its DHT process, p2pd
    finally:
        for process in running(tree + (process_tree(parent.pid) if parent.poll() is None else [])):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        parent.wait()
    log = peer_log.read_text()
    assert "SIGHUP" in log and "without announcing offline" in log and "Traceback" not in log, log
    assert glob.glob(str(checkpoints / "*.ckpt")) and not glob.glob(str(checkpoints / "*.tmp.*")), log


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_trainer_ends_whole(swarm, tmp_path, sig):
    report_path = tmp_path / "report.json"
    trainer = swarm.start_trainer(
        "--steps", "100000", "--batch-size", "4", "--microbatch-size", "2", "--num-stages", "1",
        "--report", str(report_path), "--stop-timeout-s", "5", name=f"trainer-{sig.name}",
    )  # fmt: skip
    wait_for(lambda: trainer_step(trainer) >= 1 or not trainer.alive, 120, "the trainer's first step")
    assert trainer.alive, trainer.log()
    signal_main_and_wait(trainer.popen, sig, least=3)
    leftovers = glob.glob(str(tmp_path / "*.tmp.*"))
    if sig == signal.SIGKILL:  # killed mid-write, it may leave its temporary (the next run removes
        # it: process/atomic_files.py), never a half-written report
        assert leftovers in ([], [f"{report_path}.tmp.{trainer.popen.pid}"]), leftovers
        if report_path.exists():
            json.loads(report_path.read_text())
        return
    assert not leftovers
    if sig != signal.SIGTERM:
        return
    report = json.loads(report_path.read_text())
    assert report["stopped_early"] and not report["completed"], report
    assert report["steps"] >= 1
    assert "stopped early" in trainer.log() and "Traceback" not in trainer.log(), trainer.log()


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_demo_ends_whole(tmp_path, sig):
    log_path = tmp_path / "demo.log"
    args = ["demo", "--model", "tiny", "--peers", "1", "--stages", "1", "--steps", "100000", "--tokenizer", "bytes",
            "--eval-every", "0", "--batch-size", "4", "--microbatch-size", "2", "--workdir", str(tmp_path / "work")]  # fmt: skip
    with open(log_path, "w") as log:
        demo = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
    try:
        wait_for(lambda: trainer_step_in(log_path.read_text()) or demo.poll() is not None, 180, "the demo's first step")
        assert demo.poll() is None, log_path.read_text()
        # the fork server of its processes (its folder holds the socket and their exit codes)
        servers = [p for p in psutil.Process(demo.pid).children() if "process.fork_server" in p.cmdline()]
        assert len(servers) == 1, [p.cmdline()[:4] for p in process_tree(demo.pid)]
        command = servers[0].cmdline()
        server_folder = os.path.dirname(command[command.index("process.fork_server") + 1])
        assert os.path.isdir(server_folder)
        sockets = bound_sockets(process_tree(demo.pid))
        assert sum("hivemind-p2pclient-" in path for path in sockets) >= 2, sockets  # the peer's, the trainer's
        # bootstrap, peer and trainer, each with its DHT process and p2pd
        # Killed, the demo's children get the parent-death signal and stop without the DHT goodbyes.
        signal_main_and_wait(demo, sig, least=7)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    if sig == signal.SIGTERM:
        assert "all processes stopped" in log_path.read_text(), log_path.read_text()
    assert not os.path.exists(server_folder), "the fork server's folder outlived the demo"
    # nothing left in /tmp: hivemind leaves each process's p2p client socket unless it is closed
    # (dht/node.py, with_p2p_client)
    assert not [path for path in sockets if os.path.exists(path)], sockets


def trainer_step_in(text: str) -> bool:
    return re.search(r"step\s+\d+/", text) is not None
