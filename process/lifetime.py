"""How a process ends: its children die with it, and SIGTERM or SIGINT stops it in order.

Children. hivemind forks a Python process for the DHT node (and one per averager) and that process
spawns the `p2pd` daemon; none of them may outlive the process that started them, also when it is
killed with SIGKILL (the OOM killer's signal), where no cleanup code of ours runs. So every child is
bound to its parent by the kernel: a forked Python child asks for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`), or, when it was forked from a thread other than the main one (the
signal follows the forking *thread*), watches its parent's pid from a thread. `p2pd` gets SIGTERM
when its parent dies. Each child also gets a process group of its own, so that a supervisor's
SIGTERM to our process group reaches only the main process, which then stops its children in order
(the DHT and p2pd last) instead of losing them first.

Signals. `ShutdownSignals` gives every role the same handling: the first SIGINT or SIGTERM asks for
an orderly stop (a callback of the role), the second exits at once (the children follow through
the parent-death signal).

Parent death. A role started by another of ours (`swarm demo`, the tests' `LocalSwarm`) gets
SIGHUP (`PARENT_DEATH_SIGNAL`) when that parent dies, however it dies: the swarm it belongs to is
going down with it, so the role keeps only what must outlive it (a peer's checkpoint, a trainer's
report) and skips the goodbyes that need other nodes (their DHT writes would wait out their
deadlines against a bootstrap node that is gone). The kernel sends the signal again for each
thread of the parent that exits after the first, so a repeat is never taken as "stop at once".
A terminal that closes sends the same signal to a role run in the foreground, with the same meaning.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGHUP
EXIT_SIGNALLED = 130
WATCHDOG_PERIOD_S = 0.5

_installed = False
_forked_from_main_thread = True
_forking_pid = 0


class _Keeper:
    """multiprocessing keeps its after-fork callbacks in a weak registry: this object holds ours."""


_KEEPER = _Keeper()


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    """In a child forked off a side thread: kill this process once its parent is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _note_fork() -> None:  # runs in the parent just before every os.fork
    global _forked_from_main_thread, _forking_pid
    _forked_from_main_thread = threading.current_thread() is threading.main_thread()
    _forking_pid = os.getpid()


def _bind_forked_child(_keeper: object) -> None:  # runs in every multiprocessing child before run()
    parent = _forking_pid
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    if not (_forked_from_main_thread and set_parent_death_signal(signal.SIGKILL)):
        _watch_parent(parent)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _is_p2pd(program: object) -> bool:
    return os.path.basename(str(program)) == "p2pd"


def _bound_p2pd(parent_pid: int, from_main_thread: bool) -> Callable[[], None]:
    def preexec() -> None:  # in the forked child, before exec: the settings survive exec
        os.setpgid(0, 0)
        if from_main_thread:
            set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _wrap_subprocess_exec(create: Callable) -> Callable:
    async def create_subprocess_exec(program, *args, **kwargs):
        if _is_p2pd(program) and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = _bound_p2pd(os.getpid(), threading.current_thread() is threading.main_thread())
        return await create(program, *args, **kwargs)

    create_subprocess_exec.__wrapped__ = create
    return create_subprocess_exec


def bind_children_to_parent() -> None:
    """From now on, every multiprocessing child and every `p2pd` this process starts dies with it.
    Call it once, early, in the main thread of every role's process."""
    global _installed
    if _installed:
        return
    _installed = True
    os.register_at_fork(before=_note_fork)
    multiprocessing.util.register_after_fork(_KEEPER, _bind_forked_child)
    asyncio.subprocess.create_subprocess_exec = _wrap_subprocess_exec(asyncio.subprocess.create_subprocess_exec)


def die_with_parent(sig: int = PARENT_DEATH_SIGNAL) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that binds the child to this process (None off the
    main thread, where the signal would follow the calling thread, not the process). A role of ours
    takes the default, SIGHUP, as "the swarm is going down: keep what matters, stop now". The child
    starts with the signal's default action: an ignored signal survives exec, and under `nohup`
    SIGHUP is ignored, so a bound child would otherwise outlive its parent."""
    if threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def preexec() -> None:
        signal.signal(sig, signal.SIG_DFL)
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant of it now, parents first (from /proc; [pid] where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        tree.append(current)
        queue += children.get(current, [])
    return tree


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), to tell it from a later process given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def ends_by_itself(pid: int) -> bool:
    """torch's shared-memory manager, which a process starts where hivemind shares tensors through
    files (HIVEMIND_MEMORY_SHARING_STRATEGY=file_system; dht/node.py passes file descriptors
    otherwise): it exits about 2 s after its last client, removing its folder in /tmp
    (`torch-shm-dir-*`) then. Killed, it leaves the folder behind."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "torch_shm_manag"  # the kernel keeps 15 characters of the name
    except OSError:
        return False


def kill_leftovers(pids: list[tuple[int, int | None]]) -> None:
    """SIGKILL each (pid, start time) still running as the same process, but for one that ends by
    itself once its clients are gone (`ends_by_itself`)."""
    for pid, started in pids:
        if started is not None and start_time(pid) == started and not ends_by_itself(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class ShutdownSignals:
    """SIGINT and SIGTERM: the first calls `on_stop` (the role's orderly stop), the second exits at
    once with status 130. SIGHUP (`PARENT_DEATH_SIGNAL`, however often it comes) calls
    `on_parent_gone` once, the role's quick stop (`on_stop` when not given), and sets `parent_gone`.
    `install()` for a plain process, `install_in_loop(loop)` for asyncio."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, PARENT_DEATH_SIGNAL)

    def __init__(
        self,
        on_stop: Callable[[], None],
        *,
        what: str = "stopping",
        say: Callable[[str], None] | None = None,
        on_parent_gone: Callable[[], None] | None = None,
        what_alone: str = "stopping now",
    ):
        self.on_stop, self.what = on_stop, what
        self.on_parent_gone, self.what_alone = on_parent_gone or on_stop, what_alone
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.received = 0
        self.parent_gone = False

    def handle(self, signum: int = signal.SIGTERM, _frame: object = None) -> None:
        name = signal.Signals(signum).name
        if signum == PARENT_DEATH_SIGNAL:
            if not self.parent_gone:
                self.parent_gone = True
                self.say(f"{name}: the process that started this one is gone: {self.what_alone}")
                self.on_parent_gone()
            return
        self.received += 1
        if self.received > 1:
            self.say(f"{name} again: stopping at once")
            os._exit(EXIT_SIGNALLED)
        self.say(f"{name}: {self.what} (send it again to stop at once)")
        self.on_stop()

    @property
    def requested(self) -> bool:
        return self.received > 0 or self.parent_gone

    def install(self) -> ShutdownSignals:
        for sig in self.SIGNALS:
            signal.signal(sig, self.handle)
        return self

    def install_in_loop(self, loop: asyncio.AbstractEventLoop) -> ShutdownSignals:
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self.handle, sig)
        return self


def stop_events_in_loop(*, what: str, what_alone: str) -> tuple[asyncio.Event, asyncio.Event]:
    """`(stop, alone)` for an asyncio role, with `ShutdownSignals` installed in the running loop:
    `stop` is set by the first SIGINT/SIGTERM (the orderly stop, `what`) and by SIGHUP, the
    parent-death signal, which also sets `alone` (stop without talking to the others, `what_alone`)."""
    stop, alone = asyncio.Event(), asyncio.Event()

    def parent_gone() -> None:
        alone.set()
        stop.set()

    ShutdownSignals(stop.set, what=what, on_parent_gone=parent_gone, what_alone=what_alone).install_in_loop(
        asyncio.get_running_loop()
    )
    return stop, alone


class StopRequested(Exception):
    """Raised in the main thread by a role whose orderly stop unwinds its own stack (the demo)."""


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
