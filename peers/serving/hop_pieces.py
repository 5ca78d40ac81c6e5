"""Where a chained call in pieces meets its other streams: the receiver's side of ChainRequest.pieces.

A peer sends a hop's tensors on several streams at once, each piece small enough never to wait for
a stream window update that queues behind the other direction's traffic (wire/bounded_streams.py,
`call_on_streams`). The call's own stream (RPC_TRAIN_CHAIN) carries the header and the first group
of parts; each other stream (RPC_CHAIN_PIECE) carries a `ChainPiece` header naming the call's
`hop_id` and its index, and its group. They arrive in any order:

    ChainService.rpc_train_chain                  ChainService.rpc_chain_piece (one per piece)
    parts = await pieces.collect(caller, hop,     answer = await pieces.deliver(caller, hop, i, parts,
                                 count, wait_s)                                  claim_s, timeout_s)
    ... computes, the chain's later stages ...        (waits for its answer)
    pieces.answer(caller, hop, groups[1:])        yields `answer`, then pieces.sent(caller, hop, i)
    yields groups[0]; await pieces.all_sent(...)
    pieces.close(caller, hop)    (always, also when the call failed: a waiting piece answers nothing)

A piece is kept under the caller that sent it, so only that caller's call can take it. What a piece
holds is counted in the caller's share of the in-flight budget by the admission guard until it is
answered; a piece no call takes within `claim_s` (the request deadline) answers nothing and is
dropped, and a caller may have at most `max_hops_per_caller` calls in pieces open at once.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from wire.protocol import ProtocolError

RECENTLY_CLOSED = 4096  # calls remembered as closed, so that a piece arriving late answers at once


class MissingPiecesError(Exception):
    """A call in pieces whose other streams did not all arrive in time (the caller's streams broke,
    most likely: not held against it)."""


@dataclass
class _Hop:
    parts: dict[int, tuple] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set at each piece's arrival
    claimed: asyncio.Event = field(default_factory=asyncio.Event)  # its call took the pieces, or ended
    answers: dict[int, asyncio.Future] = field(default_factory=dict)
    sent: dict[int, asyncio.Future] = field(default_factory=dict)


class HopPieces:
    def __init__(self, *, max_hops_per_caller: int = 64):
        self.max_hops_per_caller = max_hops_per_caller
        self._hops: dict[tuple[str, str], _Hop] = {}
        self._closed: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def open_hops(self, caller: str | None = None) -> int:
        """Calls in pieces this peer holds pieces or answers for (from `caller`, or in all)."""
        return sum(1 for key in self._hops if caller is None or key[0] == caller)

    def _hop(self, caller: str, hop_id: str) -> _Hop:
        key = (caller, hop_id)
        if key not in self._hops:
            if self.open_hops(caller) >= self.max_hops_per_caller:
                raise ProtocolError(f"more than {self.max_hops_per_caller} calls in pieces open at once")
            self._hops[key] = _Hop()
        return self._hops[key]

    # --- the call's side ---------------------------------------------------------------------------
    async def collect(self, caller: str, hop_id: str, count: int, wait_s: float) -> list:
        """The parts of pieces 1 to `count - 1` of the call `hop_id` from `caller`, in order, once
        all arrived; MissingPiecesError when they did not within `wait_s`."""
        if (caller, hop_id) in self._closed:
            raise ProtocolError(f"call {hop_id} was already served")
        hop = self._hop(caller, hop_id)
        try:
            async with asyncio.timeout(wait_s):
                while missing := [i for i in range(1, count) if i not in hop.parts]:
                    hop.arrived.clear()
                    await hop.arrived.wait()
        except TimeoutError:
            raise MissingPiecesError(
                f"pieces {missing} of {count} of this call did not arrive within {wait_s:.0f} s"
            ) from None
        hop.claimed.set()
        return [part for i in range(1, count) for part in hop.parts.pop(i)]

    def answer(self, caller: str, hop_id: str, groups: list[list]) -> None:
        """Each piece's answer: `groups[i - 1]` goes back on piece `i`'s stream."""
        hop = self._hops.get((caller, hop_id))
        if hop is None:
            return
        for index, group in enumerate(groups, 1):
            future = hop.answers.setdefault(index, asyncio.get_running_loop().create_future())
            if not future.done():
                future.set_result(group)

    async def all_sent(self, caller: str, hop_id: str, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every piece stream that waits for its answer wrote it."""
        hop = self._hops.get((caller, hop_id))
        if hop is not None and hop.sent:
            await asyncio.wait(list(hop.sent.values()), timeout=timeout_s)

    def close(self, caller: str, hop_id: str) -> None:
        """The call ended (answered or failed): pieces still waiting answer nothing; later ones too."""
        key = (caller, hop_id)
        hop = self._hops.pop(key, None)
        self._closed[key] = None
        while len(self._closed) > RECENTLY_CLOSED:
            self._closed.popitem(last=False)
        if hop is not None:
            for future in hop.answers.values():
                if not future.done():
                    future.set_result([])
            hop.claimed.set()

    # --- a piece's side ----------------------------------------------------------------------------
    async def deliver(
        self, caller: str, hop_id: str, index: int, parts: tuple, *, claim_s: float, timeout_s: float
    ) -> list:
        """Hand piece `index`'s parts to its call and wait for the piece's answer: what its stream
        sends back (empty when the call failed, or took no piece within `claim_s`, or gave no answer
        within `timeout_s`). Call `sent` once that is written."""
        key = (caller, hop_id)
        if key in self._closed:
            return []
        hop = self._hop(caller, hop_id)
        if index in hop.parts or index in hop.answers:
            raise ProtocolError(f"piece {index} of call {hop_id} was sent twice")
        loop = asyncio.get_running_loop()
        answer = hop.answers.setdefault(index, loop.create_future())
        hop.sent[index] = loop.create_future()
        hop.parts[index] = parts
        hop.arrived.set()
        try:
            async with asyncio.timeout(claim_s):
                await hop.claimed.wait()
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(answer)
        except TimeoutError:
            if self._hops.get(key) is hop and not hop.claimed.is_set():
                self.close(caller, hop_id)  # nobody took it: drop the others' parts too
            return []

    def sent(self, caller: str, hop_id: str, index: int) -> None:
        """Piece `index`'s answer is written (or its stream ended)."""
        hop = self._hops.get((caller, hop_id))
        future = hop.sent.get(index) if hop is not None else None
        if future is not None and not future.done():
            future.set_result(None)
