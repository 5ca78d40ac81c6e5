"""The fork server (process/fork_server.py) of the tests and `swarm demo`: what it starts behaves as a process
started with `python -m swarm.cli` does, as far as the tests look: its output, exit code, death by a
signal, environment and session."""

import os
import signal

import pytest


def test_a_forked_command_writes_its_log_and_exits_with_its_code(fork_server, tmp_path):
    log = str(tmp_path / "help.log")
    helped = fork_server.launch(["--help"], dict(os.environ), log)
    assert helped.wait(timeout=60) == 0
    assert "usage: swarm" in open(log).read()
    refused = fork_server.launch(["peer", "--no-such-flag"], dict(os.environ), str(tmp_path / "refused.log"))
    assert refused.wait(timeout=60) == 2
    assert "unrecognized arguments: --no-such-flag" in open(tmp_path / "refused.log").read()


def test_a_forked_process_has_its_own_session_from_the_start_and_dies_by_a_signal(fork_server, tmp_path):
    node = fork_server.launch(
        ["dht", "--maddrs-file", str(tmp_path / "maddrs")], dict(os.environ), str(tmp_path / "dht.log")
    )
    try:
        assert node.poll() is None
        assert os.getsid(node.pid) == node.pid  # at once: a killpg right after the start stops it and only it
    finally:
        os.killpg(node.pid, signal.SIGKILL)
    assert node.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(node.pid, 0)


@pytest.mark.parametrize("debug", [False, True])
def test_a_forked_process_runs_with_the_environment_it_was_given(fork_server, tmp_path, debug):
    env = {**os.environ, "SWARM_DEBUG": "1"} if debug else {k: v for k, v in os.environ.items() if k != "SWARM_DEBUG"}
    log = tmp_path / "prepare.log"
    failed = fork_server.launch(
        ["data", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "out")], env, str(log)
    )
    assert failed.wait(timeout=60) == (1 if debug else 2)  # SWARM_DEBUG: the traceback instead of one line
    assert ("Traceback" in log.read_text()) == debug and "missing.txt" in log.read_text()
