"""Sending on one link in turn: a peer's chained calls send their tensors to one peer one at a time.

Under direct routing a peer has several microbatches in flight to the same next replica (and answers
several gradients to the same caller). Sent at once, they share the link fairly and all arrive
together at the end, so every microbatch waits for the whole batch to cross each link and the next
hop starts only then: the links of the pipeline take turns instead of working at once. Sent in turn
(first come, first sent: asyncio's lock wakes its waiters in order), the first microbatch arrives
after its own transfer time and moves on to the next stage while the second crosses, as in a
pipeline (measured on the emulated world-wide network: benchmarks/RESULTS.md, "Direct routing on
world4").

A turn is the writing of one stream's messages (what the transport accepts before it pushes back):
`in_turn` wraps a stream's messages; `turn` is held while a call in pieces writes all its streams. A turn is never waited for longer than `max_wait_s` (then the
stream goes without one), so a stream that stalls holding its turn delays the others by that much
at most, never forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

DEFAULT_MAX_WAIT_S = 10.0


class LinkTurns:
    def __init__(self, *, max_wait_s: float = DEFAULT_MAX_WAIT_S):
        self.max_wait_s = max_wait_s
        self._locks: dict[str, asyncio.Lock] = {}

    async def in_turn(self, peer_id: str, messages: AsyncIterator | Iterable) -> AsyncIterator:
        """`messages`, yielded once this stream's turn on the link to `peer_id` came (or
        `max_wait_s` passed); the turn ends after the last one, or when the stream is closed."""
        async with self.turn(peer_id):
            if hasattr(messages, "__aiter__"):
                async for message in messages:
                    yield message
            else:
                for message in messages:
                    yield message

    @asynccontextmanager
    async def turn(self, peer_id: str) -> AsyncIterator[None]:
        """Held while it is this sender's turn on the link to `peer_id` (entered once the turn came,
        or `max_wait_s` passed)."""
        lock = self._locks.setdefault(peer_id, asyncio.Lock())
        try:
            async with asyncio.timeout(self.max_wait_s):  # queued at once, in this task: no race to the lock
                held = await lock.acquire()
        except TimeoutError:
            held = False
        try:
            yield
        finally:
            if held:
                lock.release()
            if not lock.locked() and not getattr(lock, "_waiters", None):
                self._locks.pop(peer_id, None)  # nobody waits: forget the link
