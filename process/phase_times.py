"""Where a process's time goes, by phase: cheap counters that the hot path adds to.

`PhaseTimes.timed(phase)` (a context manager) adds one count, the wall seconds and this thread's
CPU seconds (`time.thread_time`) of a synchronous section to its phase's totals; `add` takes a span
measured otherwise (an `await`, whose CPU belongs to whatever else the event loop ran meanwhile:
wall time only). Two clock reads and a lock per section, about a microsecond: cheap enough for
every request. `snapshot()` reads the totals (phase -> count, wall s, CPU s) from any thread.

`PhaseCollector` exports them as Prometheus counters `<prefix>_phase_seconds_total{phase}`,
`<prefix>_phase_cpu_seconds_total{phase}` and `<prefix>_phase_calls_total{phase}`, read at
scrape time (rate() of the first: the share of wall time a phase takes). What each phase means
is the caller's to document (peers/metrics.py, swarm/trainer/metrics.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class PhaseTotal:
    calls: int
    wall_s: float
    cpu_s: float


class PhaseTimes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}

    def add(self, phase: str, wall_s: float, cpu_s: float = 0.0, calls: int = 1) -> None:
        with self._lock:
            total = self._totals.setdefault(phase, [0, 0.0, 0.0])
            total[0] += calls
            total[1] += wall_s
            total[2] += cpu_s

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - wall, time.thread_time() - cpu)

    def snapshot(self) -> dict[str, PhaseTotal]:
        with self._lock:
            return {phase: PhaseTotal(int(c), w, cpu) for phase, (c, w, cpu) in self._totals.items()}


class PhaseCollector(Collector):
    """Phase totals (a `PhaseTimes.snapshot`, or several merged) as three counter families, by phase."""

    def __init__(self, prefix: str, read: Callable[[], dict[str, PhaseTotal]], what: str):
        self.prefix, self.read, self.what = prefix, read, what

    def _families(self, snapshot: dict[str, PhaseTotal]) -> list[CounterMetricFamily]:
        wall = CounterMetricFamily(
            f"{self.prefix}_phase_seconds", f"Wall seconds spent in each phase of {self.what}", labels=["phase"]
        )
        cpu = CounterMetricFamily(
            f"{self.prefix}_phase_cpu_seconds",
            f"CPU seconds of the thread that ran each phase of {self.what} (synchronous phases only; 0 for waits)",
            labels=["phase"],
        )
        calls = CounterMetricFamily(
            f"{self.prefix}_phase_calls", f"Times each phase of {self.what} ran", labels=["phase"]
        )
        for phase, total in sorted(snapshot.items()):
            wall.add_metric([phase], total.wall_s)
            cpu.add_metric([phase], total.cpu_s)
            calls.add_metric([phase], total.calls)
        return [wall, cpu, calls]

    def collect(self) -> Iterable[CounterMetricFamily]:
        return self._families(self.read())

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families({})
