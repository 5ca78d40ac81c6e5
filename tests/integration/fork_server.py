"""Start the tests' `swarm` processes by forking a process that has imported the project already.

A `python -m swarm.cli ...` process spends about 2 s of CPU importing torch, hivemind and the
project before it does anything; an integration test starts four or so, and a suite run over 300.
The server imports once, then forks a child for each process a test asks for: the same
`swarm.cli` entry point, a real process with its own session, log, environment and exit code, and
two peers online in about 1.3 s instead of 3.6 s. The importing process runs no torch op and holds
one thread, so forking it is safe (forking pytest's own process, which has run torch's thread pools,
would not be).

    server = ForkServer.start(socket_dir)         # once per test session
    LocalSwarm(..., launcher=server.launch)       # each process the swarm starts

Run as `python -m tests.integration.fork_server SOCKET`: it serves until its parent (the test
session) dies or closes it, and its children die with it.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid

from hivemind.utils.mpfuture import MPFuture

import swarm.cli
from process.lifetime import die_with_parent, set_parent_death_signal

READY = "ready"


class ForkedProcess:
    """The part of `subprocess.Popen` that `ManagedProcess` and the tests use, for a child of the
    server: its exit code arrives in `status_path` once the server has reaped it."""

    def __init__(self, pid: int, args: list[str], status_path: str):
        self.pid, self.args, self.status_path = pid, args, status_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self.status_path):
            with open(self.status_path) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class ForkServer:
    def __init__(self, popen: subprocess.Popen, socket_path: str):
        self.popen, self.socket_path = popen, socket_path

    @classmethod
    def start(cls, socket_dir: str, timeout_s: float = 120.0) -> ForkServer:
        socket_path = os.path.join(socket_dir, "fork-server.sock")
        popen = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.fork_server", socket_path],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        ready, _, _ = select.select([popen.stdout], [], [], timeout_s)  # it answers after its imports
        line = popen.stdout.readline().strip() if ready else f"(nothing within {timeout_s} s)"
        if line != READY:
            popen.kill()
            popen.wait()
            raise RuntimeError(f"the fork server did not start: {line!r}")
        return cls(popen, socket_path)

    def launch(
        self, args: list[str], env: dict[str, str], log_path: str, stderr_path: str | None = None
    ) -> ForkedProcess:
        """Start `swarm.cli` with `args` (what follows `python -m swarm.cli`) in a forked child,
        its output in `log_path` (its standard error apart in `stderr_path`, if given)."""
        status_path = f"{log_path}.{uuid.uuid4().hex[:8]}.exit"  # a log's name is reused by a later process
        request = {"args": args, "env": env, "log": log_path, "err": stderr_path, "status": status_path}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(self.socket_path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(conn.makefile().readline())
        return ForkedProcess(answer["pid"], args, status_path)

    def close(self) -> None:
        self.popen.kill()  # its children get their parent-death signal
        self.popen.wait()


def _child(request: dict, started: int) -> None:
    """In the forked child: become the `swarm` process the request describes, then exit. Writes to
    `started` once it leads a session of its own."""
    code = 1
    try:
        os.setsid()
        set_parent_death_signal(signal.SIGHUP)  # what die_with_parent gives LocalSwarm's processes
        os.write(started, b"1")
        os.close(started)
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as the interpreter sets them at its start
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # hivemind's MPFuture locks are process-shared semaphores made at import: forked children
        # would share the server's with every other swarm process of the session, and one killed
        # while holding one (a SIGKILLed peer's DHT sending an update) would block all the others'
        # updates for good. A process started afresh has its own; so does each child.
        MPFuture.reset_backend()
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if request.get("err") else log
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(err, 2)
        for fd in {null, log, err}:
            os.close(fd)
        # unbuffered text, as PYTHONUNBUFFERED gives a process that starts with it
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        sys.argv = ["swarm", *request["args"]]
        try:
            swarm.cli.run()
        except SystemExit as e:  # as the interpreter ends: a message is printed, and exits 1
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        threading._shutdown()  # as an interpreter's exit: join what is not a daemon thread,
        atexit._run_exitfuncs()  # then the exit handlers
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _write_status(path: str, code: int) -> None:
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(str(code))
    os.replace(partial, path)


def serve(socket_path: str) -> None:
    # what every swarm process imports, so that no child imports it again
    import torch._dynamo  # noqa: F401  (torch's optimizers import it on first use)

    import peers.launch  # noqa: F401
    import swarm.data.prepare  # noqa: F401
    import swarm.evaluate  # noqa: F401
    import swarm.export.run  # noqa: F401
    import swarm.generate  # noqa: F401
    import swarm.status  # noqa: F401
    import swarm.trainer.run  # noqa: F401

    # What is imported now lives as long as every child: out of the collector's reach, so that a
    # child's full collections neither walk it (about 0.2 s of CPU each) nor copy the pages they touch.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print(READY, flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    statuses: dict[int, str] = {}
    while True:
        for _ in selector.select(timeout=0.05):
            conn, _ = listener.accept()
            with conn:
                request = json.loads(conn.makefile().readline())
                started_r, started_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    os.close(started_r)
                    _child(request, started_w)
                os.close(started_w)
                os.read(started_r, 1)  # its own session first: a killpg right after the answer must reach it
                os.close(started_r)
                statuses[pid] = request["status"]
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while statuses:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _write_status(statuses.pop(pid), os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    serve(sys.argv[1])
