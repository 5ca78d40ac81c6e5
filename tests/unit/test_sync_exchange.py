"""Exact sync by exchange (peers/replicas/sync_exchange.py), without a network: the mean every member
takes, the digest they must agree on, and who is answered a published gradient, when."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from peers.replicas import sync_exchange
from peers.replicas.sync_exchange import Published, SyncExchange, group_digest, weighted_mean
from wire.compression import decode, encode
from wire.protocol import ProtocolError, SyncRoundRequest

ME, A, B, STRANGER = "QmMe", "QmA", "QmB", "QmStranger"


def test_the_mean_is_weighted_by_the_samples_each_replica_served():
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([4.0, 8.0]), torch.tensor([0.0, -2.0])]
    out = torch.empty(2)
    assert weighted_mean(tensors, [1.0, 2.0, 1.0], out=out) is out
    torch.testing.assert_close(out, (tensors[0] + 2 * tensors[1] + tensors[2]) / 4)


def test_the_group_digest_names_the_members_and_their_weights_in_any_order():
    assert group_digest({A: 3, B: 5}) == group_digest({B: 5, A: 3})
    assert group_digest({A: 3, B: 5}) != group_digest({A: 3, B: 6})
    assert group_digest({A: 3, B: 5}) != group_digest({A: 3, STRANGER: 5})


def exchange_serving(stage: int = 0) -> SyncExchange:
    exchange = SyncExchange(model="tiny", timeout_s=0.5)
    averaging = SimpleNamespace(runtime=SimpleNamespace(stage=stage, num_stages=2), exchange=exchange, closing=False)
    exchange.bind(loop=asyncio.get_running_loop(), transport=object(), averaging=lambda: averaging)
    return exchange


def request(group: str, step_id: str = "run:1", stage: int = 0) -> SyncRoundRequest:
    return SyncRoundRequest(model="tiny", stage=stage, num_stages=2, step_id=step_id, group=group)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_request_before_the_commit_waits_for_it_and_each_member_gets_the_gradient_once():
    async def scenario():
        exchange = exchange_serving()
        group = group_digest({ME: 1, A: 1, B: 1})
        payload = encode(torch.arange(4, dtype=torch.float32), "none")
        early = asyncio.create_task(exchange.answer(request(group), A))
        await asyncio.sleep(0.05)
        assert not early.done()  # no commit here yet
        await exchange._publish("run:1", Published(frozenset({A, B}), group, payload))
        torch.testing.assert_close(decode(await early), torch.arange(4, dtype=torch.float32))
        with pytest.raises(ProtocolError, match="went to the caller already"):
            await exchange.answer(request(group), A)
        assert "run:1" in exchange.published  # B has not fetched it yet
        await exchange.answer(request(group), B)
        assert "run:1" not in exchange.published  # every other member has it: dropped

    run(scenario())


def test_only_the_members_the_commit_names_asking_for_the_same_group_are_answered():
    async def scenario():
        exchange = exchange_serving()
        group = group_digest({ME: 1, A: 1})
        await exchange._publish("run:1", Published(frozenset({A}), group, encode(torch.zeros(3), "none")))
        with pytest.raises(ProtocolError, match="does not name the caller"):
            await exchange.answer(request(group), STRANGER)
        with pytest.raises(ProtocolError, match="other replicas or samples"):
            await exchange.answer(request(group_digest({ME: 1, A: 2})), A)
        with pytest.raises(ProtocolError, match="serves tiny stage 0/2"):
            await exchange.answer(request(group, stage=1), A)
        with pytest.raises(ProtocolError, match="no commit of this step"):
            await exchange.answer(request(group, step_id="run:2"), A)  # waits out the timeout (0.5 s)

    run(scenario())


def test_waiting_requests_are_bounded_and_a_peer_without_an_exchange_refuses(monkeypatch):
    monkeypatch.setattr(sync_exchange, "MAX_WAITING", 2)

    async def scenario():
        exchange = exchange_serving()
        group = group_digest({ME: 1, A: 1})
        waiting = [asyncio.create_task(exchange.answer(request(group, f"run:{i}"), A)) for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(ProtocolError, match="too many requests wait"):
            await exchange.answer(request(group, "run:9"), A)
        for task in waiting:
            task.cancel()
        other = SyncExchange(model="tiny", timeout_s=0.5)  # never bound: no averaging
        with pytest.raises(ProtocolError, match="takes no exact sync rounds"):
            await other.answer(request(group), A)

    run(scenario())


def test_a_replica_holds_its_latest_rounds_only():
    async def scenario():
        exchange = exchange_serving()
        for i in range(sync_exchange.HELD_ROUNDS + 3):
            await exchange._publish(f"run:{i}", Published(frozenset({A}), "g", encode(torch.zeros(1), "none")))
        assert list(exchange.published) == [f"run:{i}" for i in range(3, sync_exchange.HELD_ROUNDS + 3)]

    run(scenario())


class HangingTransport:
    """A member that never answers (a stalled replica)."""

    async def iterate(self, *args, **kwargs):
        await asyncio.sleep(3600)


def test_a_round_waiting_for_a_member_ends_at_once_when_the_peer_stops(caplog):
    caplog.set_level(logging.INFO, logger="peers.replicas.sync_exchange")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        exchange = SyncExchange(model="tiny", timeout_s=60.0)
        averaging = SimpleNamespace(runtime=SimpleNamespace(stage=0, num_stages=2), exchange=exchange, closing=False)

        async def bind():
            exchange.bind(loop=loop, transport=HangingTransport(), averaging=lambda: averaging)

        asyncio.run_coroutine_threadsafe(bind(), loop).result(timeout=5)
        flat = torch.ones(8)
        threading.Timer(0.3, exchange.cancel).start()
        assert exchange.average(flat, leader=None, step_id="run:1", me=ME, weights={ME: 1.0, A: 1.0}) is False
        assert "the round was cancelled" in caplog.text  # ended by the cancel, not by the 60 s timeout
        torch.testing.assert_close(flat, torch.ones(8))  # a failed round leaves the gradient as it was
        assert not exchange.in_flight
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()
