"""A peer's compute clock (peers/compute/utilization.py) and the phase counters every process keeps
(process/phase_times.py): busy time merged over overlapping work, the busy fraction of a window and
between two readings, and per-phase wall and CPU seconds, exported to Prometheus."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from peers.compute.utilization import ComputeClock, busy_fraction
from process.phase_times import PhaseCollector, PhaseTimes


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def busy_for(clock: FakeClock, seconds: float):
    def work():
        clock.now += seconds
        return seconds

    return work


def test_busy_time_and_the_busy_fraction_of_a_window():
    now = FakeClock()
    clock = ComputeClock(clock=now)
    assert clock.run(busy_for(now, 3.0)) == 3.0  # busy 100-103
    now.now += 1.0  # idle 103-104
    clock.run(busy_for(now, 6.0))  # busy 104-110
    assert clock.busy_s() == pytest.approx(9.0)
    assert clock.utilization(10.0) == pytest.approx(0.9)  # 100-110
    assert clock.utilization(6.5) == pytest.approx(6.0 / 6.5)  # 103.5-110
    now.now += 10.0  # idle 110-120
    assert clock.utilization(10.0) == 0.0 and clock.utilization(1000.0) == pytest.approx(9.0 / 20.0)
    first = (0.0, 0.0)
    assert busy_fraction(first, clock.reading()) == pytest.approx(9.0 / 20.0)
    assert busy_fraction(clock.reading(), clock.reading()) is None


def test_work_that_overlaps_is_counted_once():
    now = FakeClock()
    clock = ComputeClock(clock=now)
    clock._add(100.0, 104.0)
    clock._add(102.0, 106.0)  # e.g. CUDA work the thread queued while the stream still ran the last
    now.now = 110.0
    assert clock.busy_s() == pytest.approx(6.0) and clock.utilization(10.0) == pytest.approx(0.6)


def test_a_failed_compute_still_counts_the_time_it_was_busy():
    now = FakeClock()
    clock = ComputeClock(clock=now)

    def fails():
        now.now += 2.0
        raise ValueError("bad inputs")

    with pytest.raises(ValueError):
        clock.run(fails)
    assert clock.busy_s() == pytest.approx(2.0)


def test_old_intervals_leave_the_window_but_not_the_total():
    now = FakeClock()
    clock = ComputeClock(clock=now)
    for _ in range(5000):  # more than are kept for the window
        clock.run(busy_for(now, 0.01))
        now.now += 0.01
    assert clock.busy_s() == pytest.approx(50.0) and clock.utilization(10.0) == pytest.approx(0.5, abs=0.01)


def test_phase_times_count_wall_and_this_threads_cpu_and_export_them():
    phases = PhaseTimes()
    with phases.timed("decode"):
        deadline = time.thread_time() + 0.02
        while time.thread_time() < deadline:  # CPU work
            pass
    with phases.timed("decode"):
        time.sleep(0.02)  # a wait: wall, no CPU
    phases.add("receive", 0.5)
    totals = phases.snapshot()
    assert totals["decode"].calls == 2 and totals["decode"].wall_s >= 0.04
    assert 0.015 <= totals["decode"].cpu_s < totals["decode"].wall_s
    assert (totals["receive"].calls, totals["receive"].wall_s, totals["receive"].cpu_s) == (1, 0.5, 0.0)
    registry = CollectorRegistry()
    registry.register(PhaseCollector("swarm_peer", phases.snapshot, "a peer's requests"))
    assert registry.get_sample_value("swarm_peer_phase_seconds_total", {"phase": "receive"}) == 0.5
    assert registry.get_sample_value("swarm_peer_phase_calls_total", {"phase": "decode"}) == 2
    assert registry.get_sample_value("swarm_peer_phase_cpu_seconds_total", {"phase": "decode"}) >= 0.015


def test_results_still_on_their_way_to_the_host_are_waited_for_off_the_event_loop():
    """On CUDA a stage's outputs and loss leave as pinned host tensors whose copy may still run, each
    with a CUDA event (StageRuntime._to_wire); the serving layer waits for those events in a helper
    thread. Here the events are stand-ins that record which thread waited."""
    import asyncio
    import threading

    import torch

    from peers.serving.stage_rpc import on_host

    class Event:
        waited_on = None

        def synchronize(self):
            self.waited_on = threading.current_thread()

    outputs, loss = torch.ones(2, 3), torch.tensor(2.5)
    outputs.ready, loss.ready = Event(), Event()
    got = asyncio.run(on_host([outputs, loss, None]))
    assert got[0] is outputs and got[1] == 2.5 and isinstance(got[1], float) and got[2] is None
    assert outputs.ready.waited_on not in (None, threading.main_thread())
    plain = [torch.ones(1), 1.0]  # on the CPU: nothing to wait for, no thread hop
    assert asyncio.run(on_host(plain)) is plain
