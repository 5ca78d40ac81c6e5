"""DHT writes retry a transient refusal (a store no node accepted) with backoff inside their deadline."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import Future

from dht.subkey_records import await_store, retry_delays, wait_store


def answers(*results):
    """A `store` callable whose n-th call returns a future resolved with results[n] (then the last)."""
    calls = []

    def store(make):
        value = results[min(len(calls), len(results) - 1)]
        calls.append(value)
        return make(value)

    return store, calls


def resolved(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def test_the_backoff_doubles_up_to_its_cap():
    assert list(itertools.islice(retry_delays(0.2, 1.0), 5)) == [0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_refused_write_is_tried_again_until_a_node_accepts_it():
    store, calls = answers(False, False, True)
    assert wait_store(lambda: store(resolved), timeout_s=10.0, what="test") is True
    assert calls == [False, False, True]


def test_a_write_no_node_ever_accepts_gives_up_by_its_deadline():
    store, calls = answers(False)
    started = time.monotonic()
    assert wait_store(lambda: store(resolved), timeout_s=1.0, what="test") is False
    assert time.monotonic() - started <= 1.0 and len(calls) >= 2


def test_the_async_write_retries_too():
    async def scenario():
        loop = asyncio.get_running_loop()

        def make(value):
            future = loop.create_future()
            future.set_result(value)
            return future

        store, calls = answers(False, True)
        return await await_store(lambda: store(make), timeout_s=10.0, what="test"), calls

    assert asyncio.run(scenario()) == (True, [False, True])
