"""Shared fixtures: real swarms on loopback, always torn down.

Every process a test starts runs in its own process group (with its DHT process and p2pd), and
`LocalSwarm.stop` kills the group; a session finalizer sweeps any group a crashed test left. The
swarms' processes are forked by one process that imported the project once
(process/fork_server.py): the same `swarm.cli`, about 2 s of CPU sooner each.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile

import pytest

from swarm.local_swarm import LocalSwarm, start_fork_server

_ALL_SWARMS: list[LocalSwarm] = []


LOG_TAIL_CHARS = 4000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails shows the end of every log its swarms' processes wrote (a CI run keeps
    nothing else of them): why a peer or the trainer did not do what the test waited for."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for swarm in getattr(item, "swarms", ()):
        for process in swarm.processes:
            tail = process.log()[-LOG_TAIL_CHARS:]
            state = "running" if process.alive else f"exited {process.popen.returncode}"
            report.sections.append((f"log of {process.name} ({state}), last {LOG_TAIL_CHARS} chars", tail))


@pytest.fixture(scope="session")
def fork_server():
    """One process that has imported the project, forking the swarms' processes (the
    `swarm.cli` they run is the same; their start is about 2 s of CPU shorter each)."""
    with start_fork_server() as server:
        yield server


@pytest.fixture(scope="session")
def swarm_cli(fork_server, tmp_path_factory):
    """`swarm ARGS...` run to its end in a process forked by the fork server (the project imported
    already, so about 2 s of CPU sooner than `python -m swarm.cli`), as `subprocess.run` with
    `capture_output=True, text=True` returns it. A call past `timeout` kills it and raises
    `subprocess.TimeoutExpired`. The tests of a first contact with the CLI (tests/integration/
    test_bad_input.py) start one `python -m swarm.cli` of their own too, import-time output included."""
    logs = tmp_path_factory.mktemp("cli")
    calls = itertools.count()

    def run(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        call = next(calls)
        out, err = logs / f"{call}.out", logs / f"{call}.err"
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        process = fork_server.launch(list(args), environment, str(out), stderr_path=str(err))
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the child leads its own session
            raise
        return subprocess.CompletedProcess(["swarm", *args], code, out.read_text(), err.read_text())

    return run


@pytest.fixture
def make_swarm(tmp_path, request, fork_server):
    """Factory: make_swarm(model="tiny", num_stages=2, peer_args=[...]) -> LocalSwarm (stopped after the test)."""
    created: list[LocalSwarm] = []
    request.node.swarms = created

    def factory(**kwargs) -> LocalSwarm:
        kwargs.setdefault("model", "tiny")
        kwargs.setdefault("launcher", fork_server.launch)
        swarm = LocalSwarm(workdir=str(tmp_path / f"swarm{len(created)}"), **kwargs)
        created.append(swarm)
        _ALL_SWARMS.append(swarm)
        return swarm

    yield factory
    for swarm in created:
        swarm.stop()


@pytest.fixture(scope="module")
def module_swarm(tmp_path_factory, fork_server):
    """Factory for swarms shared by a module's tests (start the processes once, reuse them)."""
    created: list[LocalSwarm] = []

    def factory(**kwargs) -> LocalSwarm:
        kwargs.setdefault("model", "tiny")
        kwargs.setdefault("launcher", fork_server.launch)
        swarm = LocalSwarm(workdir=str(tmp_path_factory.mktemp("swarm")), **kwargs)
        created.append(swarm)
        _ALL_SWARMS.append(swarm)
        return swarm

    yield factory
    for swarm in created:
        swarm.stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_every_swarm_at_exit():
    yield
    for swarm in _ALL_SWARMS:
        swarm.stop()


def pytest_configure(config):
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    # Data prepared on the fly (the default corpus, text files) goes to a folder of this session's
    # own, which every process a test starts inherits: nothing is left in the user's ~/.cache.
    if "SWARM_CACHE_DIR" not in os.environ:
        cache = tempfile.mkdtemp(prefix="swarm-test-cache-")
        os.environ["SWARM_CACHE_DIR"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    # The processes the tests start (a few per test, hundreds in all) import the project's modules
    # from source: where PYTHONDONTWRITEBYTECODE is set, each would compile all of them again (about
    # 0.25 s of CPU each). They keep the compiled files, as Python does by default (git ignores them).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
