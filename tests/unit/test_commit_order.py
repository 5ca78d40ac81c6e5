"""peers/serving/commit_order.py: a call that follows a commit waits until that commit is handled,
at once when it already was, and for its bound at most when it never comes; wire/protocol.py's
FollowsCommit names the peers it holds."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from peers.serving.commit_order import CommitOrder
from wire.protocol import MAX_FOLLOWING_PEERS, ChainRequest, FollowsCommit, RequestHeader


def test_a_call_that_arrives_before_its_commit_waits_for_it_and_one_after_does_not():
    async def scenario():
        order = CommitOrder()
        early = asyncio.create_task(order.wait("run:3", timeout_s=5.0))
        await asyncio.sleep(0.05)
        assert not early.done() and not order.handled("run:3")  # not handled yet: the call holds
        order.done("run:3")
        assert await early is True and order.handled("run:3")
        return await order.wait("run:3", timeout_s=0.0)  # handled already: no wait

    assert asyncio.run(scenario()) is True


def test_several_calls_wait_for_one_commit_and_a_commit_that_never_comes_holds_them_for_the_bound():
    async def scenario():
        order = CommitOrder()
        waits = [asyncio.create_task(order.wait("run:1", timeout_s=5.0)) for _ in range(3)]
        lost = asyncio.create_task(order.wait("run:lost", timeout_s=0.1))
        await asyncio.sleep(0.05)
        order.done("run:1")
        return await asyncio.gather(*waits), await lost

    released, lost = asyncio.run(scenario())
    assert released == [True, True, True] and lost is False


def test_it_remembers_a_bounded_number_of_commits_and_waiting_calls():
    async def scenario():
        order = CommitOrder(remembered=2)
        for step in range(3):
            order.done(f"run:{step}")
        assert not order.handled("run:0") and order.handled("run:2")  # the oldest is forgotten
        forgotten = asyncio.create_task(order.wait("run:0", timeout_s=5.0))  # so its call waits again
        await asyncio.sleep(0.01)
        assert not forgotten.done()
        other = asyncio.create_task(order.wait("never:a", timeout_s=0.2))
        await asyncio.sleep(0.01)
        # a third commit waited for pushes the oldest waiting one out: its call goes on at once (False)
        third = asyncio.create_task(order.wait("never:b", timeout_s=0.2))
        started = asyncio.get_running_loop().time()
        assert await forgotten is False
        pushed_out_s = asyncio.get_running_loop().time() - started
        return pushed_out_s, await other, await third

    pushed_out_s, other, third = asyncio.run(scenario())
    assert pushed_out_s < 1.0 and other is False and third is False


def test_follows_commit_names_its_peers_and_rides_on_both_call_headers():
    follows = FollowsCommit(step_id="run:7", peers=["peer-a", "peer-b"])
    assert follows.names("peer-a") and not follows.names("peer-c")
    header = RequestHeader(rpc="forward", model="tiny", stage=0, num_stages=2, microbatch_id="m", batch_size=2)
    assert header.follows_commit is None  # older trainers: nothing to wait for
    header = header.model_copy(update={"follows_commit": follows})
    assert RequestHeader.model_validate(header.model_dump()).follows_commit == follows
    chain = ChainRequest.model_validate(
        {
            "model": "tiny",
            "stage": 0,
            "num_stages": 2,
            "microbatch_id": "m",
            "batch_size": 2,
            "timeout_s": 5.0,
            "trainer_id": "trainer",
            "follows_commit": follows.model_dump(),
        }
    )
    assert chain.follows_commit == follows
    with pytest.raises(ValidationError):
        FollowsCommit(step_id="run:7", peers=[])
    with pytest.raises(ValidationError):
        FollowsCommit(step_id="run:7", peers=[f"p{i}" for i in range(MAX_FOLLOWING_PEERS + 1)])
