"""How busy a peer's compute is: the fraction of wall time its stage computes.

`ComputeClock.run(fn, *args)` runs a stage's compute (a forward, a backward, an evaluation) on the
calling thread, the peer's one compute thread, and records the wall interval it was busy. On CUDA
the thread is not the device: the thread returns once its kernels are queued. There the clock also
records a pair of CUDA events on the current stream around the work, and the stream's busy time is
read from the GPU's own timeline once the events have completed (`event.query()`, never a
synchronisation on the compute path); until then the thread's interval stands in.

- `busy_s()`: seconds busy since the clock started (intervals merged: work that overlaps counts once);
- `utilization(window_s)`: the busy fraction of the last `window_s` seconds;
- `reading()`: (busy seconds, this clock's seconds since it started), what a peer's answers and
  record carry so that a reader computes the busy fraction between any two readings.

What is not counted: commits (an averaging round waits on the network, not the device), the
optimizer step a commit makes, loading state. Thread-safe: the compute thread writes, the event loop
and the metrics endpoint read. No I/O.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

KEPT_INTERVALS = 4096  # the most recent busy intervals kept for `utilization` (older ones are in the total)


class ComputeClock:
    def __init__(self, device: torch.device | None = None, *, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._intervals: deque[tuple[float, float]] = deque(maxlen=KEPT_INTERVALS)  # merged, in order
        self._busy_total = 0.0  # busy seconds of every interval so far, the dropped ones included
        self._cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self._device = device
        self._reference = None  # a CUDA event at a known wall time: the GPU timeline's origin
        self._reference_at = 0.0  # ... that wall time
        self._pending: deque[tuple[Any, Any, float, float]] = deque()  # CUDA events not yet completed

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, counted as busy (on CUDA: the stream's time, once known)."""
        if not self._cuda:
            started = self._clock()
            try:
                return fn(*args)
            finally:
                self._add(started, self._clock())
        stream = torch.cuda.current_stream(self._device)
        if self._reference is None:
            self._reference = torch.cuda.Event(enable_timing=True)
            self._reference.record(stream)
            self._reference.synchronize()  # once, at the first compute: the origin's wall time
            self._reference_at = self._clock()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        started = self._clock()
        try:
            return fn(*args)
        finally:
            end.record(stream)
            with self._lock:
                self._pending.append((begin, end, started, self._clock()))
            self._resolve()

    def _resolve(self) -> None:
        """Turn completed CUDA event pairs into busy intervals on the GPU's timeline (in order)."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0][1].query():
                    return
                begin, end, _, _ = self._pending.popleft()
            origin = self._reference_at
            self._add(
                origin + self._reference.elapsed_time(begin) / 1e3, origin + self._reference.elapsed_time(end) / 1e3
            )

    def _add(self, start: float, end: float) -> None:
        if end <= start:
            return
        with self._lock:
            if self._intervals and start <= self._intervals[-1][1]:  # overlaps the last: merge
                last_start, last_end = self._intervals.pop()
                self._busy_total -= last_end - last_start
                start, end = min(start, last_start), max(end, last_end)
            self._busy_total += end - start
            self._intervals.append((start, end))

    def _pending_busy(self, since: float) -> float:
        """On CUDA, the work whose events have not completed yet: its thread intervals, a lower bound."""
        return sum(max(end - max(start, since), 0.0) for _, _, start, end in self._pending)

    def busy_s(self) -> float:
        if self._cuda:
            self._resolve()
        with self._lock:  # O(1): called for every answer
            return self._busy_total + self._pending_busy(self._started)

    def utilization(self, window_s: float) -> float:
        """The busy fraction of the last `window_s` seconds (of the clock's life, if shorter)."""
        if self._cuda:
            self._resolve()
        now = self._clock()
        since = max(now - window_s, self._started)
        with self._lock:  # the newest intervals first, back to the window's start
            busy = 0.0
            for start, end in reversed(self._intervals):
                if end <= since:
                    break
                busy += min(end, now) - max(start, since)
            busy += self._pending_busy(since)
        return min(busy / (now - since), 1.0) if now > since else 0.0

    def reading(self) -> tuple[float, float]:
        """(busy seconds, seconds since the clock started)."""
        busy = self.busy_s()
        return busy, self._clock() - self._started


def busy_fraction(first: tuple[float, float], last: tuple[float, float]) -> float | None:
    """The busy fraction between two `reading`s of one clock; None when they span no time."""
    busy, elapsed = last[0] - first[0], last[1] - first[1]
    if elapsed <= 0:
        return None
    return min(max(busy / elapsed, 0.0), 1.0)
