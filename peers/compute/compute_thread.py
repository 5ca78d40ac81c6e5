"""The peer's one compute thread, taking its work in priority order: backwards before forwards (1F1B).

`ComputeThread` is a `concurrent.futures.Executor` with one worker thread. `submit(fn, *args)`
queues at `DEFAULT` priority; `submit_at(priority, fn, *args)` at another, lower first, first come
first served among equals. When several microbatches are in flight on a peer, a backward waiting
for the thread goes before the forwards waiting with it (`BACKWARD` < `FORWARD`): its gradient
reaches the stage before sooner, which then has a backward to run instead of waiting, and the
activations it frees leave the cache sooner (a one-forward-one-backward order, as a 1F1B pipeline
schedule keeps it). A commit's local step (`STEP`) goes first of all: calls waiting beside it came
after the step was over, so they are the next step's. Everything else (a move's swap, state
exports) waits at `DEFAULT`, in order with the forwards.

`shutdown(wait, cancel_futures)` as ThreadPoolExecutor's. No I/O.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

STEP = -1  # a commit's local step: before the calls already waiting (they belong to the next step)
BACKWARD = 0
FORWARD = DEFAULT = 1


class ComputeThread(Executor):
    def __init__(self, name: str = "stage-compute"):
        self._queue: list[tuple[int, int, Future, Callable, tuple, dict]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return self.submit_at(DEFAULT, fn, *args, **kwargs)

    def submit_at(self, priority: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            heapq.heappush(self._queue, (priority, next(self._order), future, fn, args, kwargs))
            self._ready.notify()
        return future

    def queued(self) -> int:
        with self._ready:
            return len(self._queue)

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                _, _, future, fn, args, kwargs = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # handed to whoever waits for the future
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._ready:
            self._closed = True
            if cancel_futures:
                for _, _, future, *_ in self._queue:
                    future.cancel()
                self._queue.clear()
            self._ready.notify_all()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()


def submit_at(executor: Executor, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` on `executor` at `priority` when it is a ComputeThread, in its own order otherwise."""
    if isinstance(executor, ComputeThread):
        return executor.submit_at(priority, fn, *args)
    return executor.submit(fn, *args)
