"""The ways a slowed peer spends its extra time (peers/compute/faults.py): asleep, computing, or as a device."""

import time

import pytest
import torch

from peers.compute.faults import FaultSettings, FaultyStageRuntime, burn_cpu

COMPUTE_CPU_S = 0.02


class _CpuBoundRuntime:
    """Stands in for a StageRuntime: every forward uses COMPUTE_CPU_S of this thread's CPU."""

    def forward(self, microbatch_id, inputs, targets=None, tokens=None):
        burn_cpu(COMPUTE_CPU_S)
        return inputs


def _forward_costs(mode: str) -> tuple[float, float]:
    """CPU seconds (this thread) and wall seconds of one forward slowed 3x in `mode`, on one torch
    thread as a peer computes by default. With more, a product's share on another thread is not on
    this thread's clock, while this one may spin waiting for it, under load for a whole time slice:
    a clean CI run measured 0.091 CPU s for 0.06 that way. The first product of a process also pays
    torch's set-up, which the busy slowdown would multiply: it is paid before measuring."""
    runtime = FaultyStageRuntime(_CpuBoundRuntime(), FaultSettings(fault_slowdown=3.0, fault_slowdown_mode=mode))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        burn_cpu(0.001)
        cpu_started, wall_started = time.thread_time(), time.perf_counter()
        runtime.forward("mb", torch.zeros(1))
        return time.thread_time() - cpu_started, time.perf_counter() - wall_started
    finally:
        torch.set_num_threads(threads)


def test_busy_slowdown_uses_the_cpu_time_of_a_slower_device():
    cpu_s, wall_s = _forward_costs("busy")
    assert 3 * COMPUTE_CPU_S * 0.95 <= cpu_s <= 3 * COMPUTE_CPU_S * 1.5, cpu_s
    assert wall_s >= cpu_s * 0.99


def test_sleep_slowdown_waits_off_the_cpu():
    cpu_s, wall_s = _forward_costs("sleep")
    assert cpu_s <= 2 * COMPUTE_CPU_S, cpu_s  # the compute itself, not the slowdown
    assert wall_s >= 3 * COMPUTE_CPU_S * 0.95, wall_s


def test_device_slowdown_lasts_slowdown_times_the_cpu_time_whatever_the_wall_time():
    cpu_s, wall_s = _forward_costs("device")
    assert cpu_s <= 2 * COMPUTE_CPU_S, cpu_s
    assert 3 * COMPUTE_CPU_S * 0.95 <= wall_s, wall_s


def test_device_slowdown_does_not_multiply_time_spent_off_the_cpu():
    """A compute stretched by waiting (here: 60 ms asleep, as if other processes held the core) is not
    slowed further, where `sleep` triples the whole of it."""

    class _WaitingRuntime:
        def forward(self, microbatch_id, inputs, targets=None, tokens=None):
            started = time.perf_counter()
            burn_cpu(0.005)
            time.sleep(0.06)
            self.elapsed_s = time.perf_counter() - started
            return inputs

    def added_s(mode: str) -> tuple[float, float]:
        inner = _WaitingRuntime()
        runtime = FaultyStageRuntime(inner, FaultSettings(fault_slowdown=3.0, fault_slowdown_mode=mode))
        started = time.perf_counter()
        runtime.forward("mb", torch.zeros(1))
        return time.perf_counter() - started - inner.elapsed_s, inner.elapsed_s

    added, _ = added_s("device")
    assert added < 0.03, added  # 3 x ~5 ms of CPU is less than the 60 ms the compute took anyway
    added, elapsed = added_s("sleep")
    assert added >= 2 * elapsed * 0.95, (added, elapsed)


def test_burn_cpu_counts_this_threads_cpu_time():
    assert burn_cpu(0.0) == 0.0
    used = burn_cpu(0.01)
    assert 0.01 <= used < 0.05


def test_an_unknown_slowdown_mode_is_refused():
    with pytest.raises(ValueError, match="--faults slowdown_mode"):
        FaultSettings(fault_slowdown=3.0, fault_slowdown_mode="spin")
