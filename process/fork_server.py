"""Start processes of one command by forking a server that has imported what they need once.

A `swarm ...` process spends about 2 s of CPU importing torch, hivemind and the project before it
does anything; `swarm demo` starts four or five of them, an integration test run over 300. The
server imports once, then forks a child for each process asked for: the same entry point, a real
process with its own session, log, environment and exit code, two peers online in about 1.3 s
instead of 3.6 s. The server runs no torch op and holds one thread, so forking it is safe (forking
a process that has run torch's or a tokenizer's thread pools would not be).

    server = ForkServer.start(entry="swarm.cli:run_forked", preload=[...])
    LocalSwarm(..., launcher=server.launch)       # each process the swarm starts
    server.close()                                # after the processes have stopped

The server runs as `python -m process.fork_server SOCKET ENTRY [MODULE...]`, in a session of its
own (a Ctrl-C to its starter's terminal is the starter's to handle), until its starter closes it or
dies; its children get SIGHUP when it dies. Naming the entry point and the modules to import
keeps this module a leaf: it imports no project package.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence

from process.atomic_files import write_atomically
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
    """A running fork server; `launch` starts a process (the first call waits for the server's
    imports), `close` stops the server and removes its folder (with its processes' exit codes)."""

    def __init__(self, popen: subprocess.Popen, folder: str, timeout_s: float):
        self.popen, self.folder, self.timeout_s = popen, folder, timeout_s
        self.socket_path = os.path.join(folder, "fork-server.sock")
        self._ready = False

    @classmethod
    def start(cls, entry: str, preload: Sequence[str] = (), timeout_s: float = 120.0) -> ForkServer:
        """Start the server, which imports the `preload` modules and `entry` ("module:function",
        called with no argument in each child, `sys.argv` set to the child's arguments), and
        return at once: its imports run while the caller goes on."""
        folder = tempfile.mkdtemp(prefix="swarm-fork-")
        popen = subprocess.Popen(
            [sys.executable, "-m", "process.fork_server", os.path.join(folder, "fork-server.sock"), entry, *preload],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a Ctrl-C at the terminal is its starter's to handle
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        return cls(popen, folder, timeout_s)

    def wait_ready(self) -> None:
        if self._ready:
            return
        ready, _, _ = select.select([self.popen.stdout], [], [], self.timeout_s)  # it answers after its imports
        line = self.popen.stdout.readline().strip() if ready else f"(nothing within {self.timeout_s} s)"
        if line != READY:
            self.close()
            raise RuntimeError(f"the fork server did not start: {line!r}")
        self._ready = True

    def launch(
        self, args: list[str], env: dict[str, str], log_path: str, stderr_path: str | None = None
    ) -> ForkedProcess:
        """Start the entry point with `args` in a forked child, its output in `log_path` (its
        standard error apart in `stderr_path`, if given)."""
        self.wait_ready()
        status_path = os.path.join(self.folder, f"{uuid.uuid4().hex}.exit")
        request = {"args": args, "env": env, "log": log_path, "err": stderr_path, "status": status_path}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(self.socket_path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(conn.makefile().readline())
        return ForkedProcess(answer["pid"], args, status_path)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()  # its children get their parent-death signal
        self.popen.wait()
        self.popen.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(request: dict, started: int, entry: Callable[[], None]) -> None:
    """In the forked child: become the process the request describes, run `entry`, then exit as
    an interpreter does. Writes to `started` once it leads a session of its own."""
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
        sys.argv = [sys.argv[0], *request["args"]]
        try:
            entry()
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


def serve(socket_path: str, entry: str, preload: Sequence[str]) -> None:
    folder = os.path.dirname(socket_path)

    def stop(signum, frame) -> None:  # its starter died (the parent-death signal): nobody else removes it
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(128 + signum)  # the children get their parent-death signal

    signal.signal(signal.SIGTERM, stop)
    for module in preload:  # what the children import, so that none imports it again
        importlib.import_module(module)
    module, _, function = entry.partition(":")
    run = getattr(importlib.import_module(module), function)
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
                    _child(request, started_w, run)
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
            write_atomically(statuses.pop(pid), str(os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3:])
