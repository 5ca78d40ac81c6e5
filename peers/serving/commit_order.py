"""The commits a trainer's later calls follow (`swarm train --outer-commits background`).

A trainer that starts its next step while a step's commit still travels names that commit in each
call (wire/protocol.py's `FollowsCommit`). The commit and the calls cross on different streams
(and, under direct routing, the calls come from another peer), so a call can arrive first. A
replica the commit names computes such a call only once it has handled the commit (`done`, in the
commit RPC's `finally`: stepped, or failed), so the call sees the parameters the commit stepped
to, as when the trainer waited. A commit that never comes (lost on the way) holds a call for the
wait's bound at most, and the call then computes as it is (`wait` answers False).

`CommitOrder` remembers the last `remembered` commits handled. Event-loop code only; no network.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

FOLLOW_WAIT_S = 10.0  # the longest a call waits for the commit it follows


class CommitOrder:
    def __init__(self, remembered: int = 256):
        self._done: OrderedDict[str, None] = OrderedDict()
        self._waiting: dict[str, asyncio.Event] = {}
        self._remembered = remembered

    def done(self, step_id: str) -> None:
        """The commit `step_id` is handled: calls that follow it compute from now on."""
        self._done[step_id] = None
        self._done.move_to_end(step_id)
        while len(self._done) > self._remembered:
            self._done.popitem(last=False)
        event = self._waiting.pop(step_id, None)
        if event is not None:
            event.set()

    def handled(self, step_id: str) -> bool:
        """Whether the commit `step_id` is among those remembered as handled."""
        return step_id in self._done

    async def wait(self, step_id: str, timeout_s: float = FOLLOW_WAIT_S) -> bool:
        """Until the commit `step_id` is handled (True at once if it was), or `timeout_s` (False)."""
        if step_id in self._done:
            return True
        event = self._waiting.get(step_id)
        if event is None:
            event = self._waiting[step_id] = asyncio.Event()
            while len(self._waiting) > self._remembered:  # commits that never came: their calls go on
                self._waiting.pop(next(iter(self._waiting))).set()
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            return False
        return step_id in self._done
