"""process/lifetime.py without a network: stale temporaries, process trees, the parent-death signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from process.atomic_files import remove_stale_temporaries
from process.lifetime import ShutdownSignals, die_with_parent, process_tree


def test_stale_temporaries_are_removed_but_not_a_running_process_s(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"tiny-stage0of2.ckpt.tmp.{dead.stdout.strip()}"
    live = tmp_path / f"tiny-stage1of2.ckpt.tmp.{os.getppid()}"  # pytest's parent: alive
    kept = tmp_path / "tiny-stage0of2.ckpt"
    for path in (stale, live, kept):
        path.write_bytes(b"x")
    assert remove_stale_temporaries(str(tmp_path)) == [str(stale)]
    assert live.exists() and kept.exists() and not stale.exists()


def test_process_tree_lists_children_and_grandchildren():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '30'])"])
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(child.pid)
        assert tree[0] == child.pid and len(tree) == 2
    finally:
        for pid in reversed(process_tree(child.pid)):
            os.kill(pid, signal.SIGKILL)
        child.wait()


@pytest.mark.parametrize("nohup", [False, True], ids=["", "under-nohup"])
def test_a_child_bound_to_its_parent_dies_with_it_after_sigkill(nohup):
    # A middle process starts a bound grandchild, prints its pid and is killed; the grandchild must follow.
    # under-nohup: the middle ignores SIGHUP, as everything started by nohup does, and an ignored
    # signal would pass on to the grandchild through fork and exec.
    code = (
        "import signal, subprocess, sys, time\n"
        + ("signal.signal(signal.SIGHUP, signal.SIG_IGN)\n" if nohup else "")
        + "from process.lifetime import die_with_parent\n"
        "p = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent())\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ})
    grandchild = int(middle.stdout.readline())
    middle.kill()
    middle.wait()
    deadline = time.monotonic() + 10
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(grandchild)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_first_signal_asks_to_stop_and_the_second_would_exit():
    stops, lines = [], []
    signals = ShutdownSignals(lambda: stops.append(1), say=lines.append)
    signals.handle(signal.SIGTERM)
    assert stops == [1] and signals.requested and "SIGTERM" in lines[0]
    exited = subprocess.run(
        [
            sys.executable,
            "-c",
            "from process.lifetime import ShutdownSignals as S; s = S(lambda: None); s.handle(); s.handle(); print('still here')",
        ],
        capture_output=True,
        text=True,
    )
    assert exited.returncode == 130 and "still here" not in exited.stdout
    assert die_with_parent() is not None  # from the main thread


def test_the_parent_death_signal_stops_quickly_once_however_often_it_comes():
    """The kernel sends it again for each thread of the dying parent: no repeat may mean 'at once'."""
    stops, quick, lines = [], [], []
    signals = ShutdownSignals(lambda: stops.append(1), on_parent_gone=lambda: quick.append(1), say=lines.append)
    for _ in range(3):
        signals.handle(signal.SIGHUP)
    assert quick == [1] and stops == [] and signals.parent_gone and signals.requested and len(lines) == 1
    signals.handle(signal.SIGTERM)  # a stop asked for afterwards is still the first of its kind
    assert stops == [1]
