"""peers/serving/link_turns.py: streams to one peer take turns, first come first sent; streams to
other peers do not wait; a stalled turn delays the others by `max_wait_s` at most."""

from __future__ import annotations

import asyncio

from peers.serving.link_turns import LinkTurns


async def _send(turns: LinkTurns, peer: str, name: str, log: list, parts: int = 3, pause_s: float = 0.01):
    async for part in turns.in_turn(peer, [f"{name}{i}" for i in range(parts)]):
        log.append(part)
        await asyncio.sleep(pause_s)  # the transport pushing back


def test_streams_to_one_peer_go_in_turn_and_to_others_at_once():
    async def scenario():
        turns, to_a, to_b = LinkTurns(), [], []
        await asyncio.gather(
            _send(turns, "a", "x", to_a), _send(turns, "a", "y", to_a), _send(turns, "b", "z", to_b, pause_s=0.001)
        )
        return to_a, to_b

    to_a, to_b = asyncio.run(scenario())
    assert to_a == ["x0", "x1", "x2", "y0", "y1", "y2"]  # never interleaved
    assert to_b == ["z0", "z1", "z2"]


def test_a_stalled_turn_holds_the_others_back_for_max_wait_s_at_most():
    async def scenario():
        turns, log = LinkTurns(max_wait_s=0.05), []
        stalled = turns.in_turn("a", ["s0", "s1"])
        log.append(await stalled.__anext__())  # holds the turn and never finishes
        await _send(turns, "a", "x", log)  # goes without its turn after 0.05 s
        await stalled.aclose()  # its turn ends when the stream is closed
        await _send(turns, "a", "y", log, parts=1)
        return log

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=5)) == ["s0", "x0", "x1", "x2", "y0"]
