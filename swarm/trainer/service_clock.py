"""How long each replica kept the trainer's calls busy, measured on the trainer's own clock.

A replica's answer carries its own compute and queue times, but those are claims: a replica that
reports ~0 compute time looked infinitely fast to routing and drew 479 of 480 calls while cutting
throughput 10x (issue #30). Routing therefore uses only what the trainer measures itself.

The call's whole latency is not the right measure either: with several calls in flight to one
replica, a call also waits behind the trainer's own earlier calls there, so the busiest replica
would look slowest. What the trainer can measure without trusting the replica is the replica's
*service time*: a call that completes at ``done`` took ``done - max(sent, previous_done)``, where
``previous_done`` is when the trainer's previous call to the same replica completed. Over a busy
period the service times add up to the time the replica was busy with the trainer's calls, so the
rate of completions, which is what a replica's share should follow, is measured exactly, however
the replica overlaps its work. A replica can make itself look slower this way, never faster than
it answers.

Pure: no I/O, no asyncio; times are passed in (seconds, one monotonic clock).
"""

from __future__ import annotations

import math
from collections import OrderedDict

_MAX_PEERS = 4096  # peers remembered; the longest-idle one is forgotten first


class ServiceClock:
    """Per-replica completion times of the trainer's calls, giving each call's service time."""

    def __init__(self, *, max_peers: int = _MAX_PEERS) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self._max_peers = max_peers
        self._last_done_s: OrderedDict[str, float] = OrderedDict()

    def finished(self, peer_id: str, sent_s: float, done_s: float) -> float:
        """A call to `peer_id` sent at `sent_s` completed (answered or failed) at `done_s`: returns
        the seconds it kept the replica busy for this trainer, and starts the next call's clock."""
        if not (math.isfinite(sent_s) and math.isfinite(done_s) and done_s >= sent_s):
            raise ValueError(f"need finite times with done_s >= sent_s, got sent_s={sent_s} done_s={done_s}")
        previous_s = self._last_done_s.pop(peer_id, -math.inf)
        self._last_done_s[peer_id] = max(done_s, previous_s)
        while len(self._last_done_s) > self._max_peers:
            self._last_done_s.popitem(last=False)
        return max(done_s - max(sent_s, previous_s), 0.0)
