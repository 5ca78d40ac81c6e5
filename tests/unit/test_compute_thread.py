"""The peer's compute thread (peers/compute/compute_thread.py): one worker, backwards before the
forwards waiting with them, first come first served among equals, errors to the waiter, and a
shutdown that cancels what waits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from peers.compute.compute_thread import BACKWARD, FORWARD, ComputeThread, submit_at


def test_backwards_go_before_the_forwards_waiting_with_them_in_order_among_equals():
    thread, ran, gate = ComputeThread(), [], threading.Event()
    thread.submit(gate.wait)  # the thread is busy while the rest queue up
    futures = [
        thread.submit_at(FORWARD, ran.append, "f1"),
        thread.submit_at(FORWARD, ran.append, "f2"),
        thread.submit_at(BACKWARD, ran.append, "b1"),
        thread.submit(ran.append, "commit"),  # the default: in order with the forwards
        thread.submit_at(BACKWARD, ran.append, "b2"),
    ]
    gate.set()
    for future in futures:
        future.result(timeout=5)
    assert ran == ["b1", "b2", "f1", "f2", "commit"]
    thread.shutdown()


def test_one_worker_errors_to_the_waiter_and_asyncio_can_wait_for_it():
    thread = ComputeThread()
    names = {thread.submit(lambda: threading.current_thread().name).result(timeout=5) for _ in range(3)}
    assert names == {"stage-compute"}
    with pytest.raises(ZeroDivisionError):
        thread.submit(lambda: 1 / 0).result(timeout=5)

    async def main():
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(thread, sum, [1, 2]), await asyncio.wrap_future(
            submit_at(thread, BACKWARD, max, 3, 4)
        )

    assert asyncio.run(main()) == (3, 4)
    thread.shutdown()


def test_shutdown_cancels_what_waits_and_refuses_new_work():
    thread, gate, started = ComputeThread(), threading.Event(), threading.Event()
    running = thread.submit(lambda: (started.set(), gate.wait())[1])
    assert started.wait(5)
    waiting = thread.submit(lambda: "never")
    thread.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(timeout=5) is True and waiting.cancelled()
    with pytest.raises(RuntimeError):
        thread.submit(print)
