"""A bound on how much of a stage's traffic peers first seen in the last few minutes may take.

Identities are free: anyone can start peers, announce them with any throughput, and have a
trainer route to them. Measurements (swarm/trainer/service_clock.py) and bans
(swarm/trainer/failures.py) correct a bad peer only after it has taken calls; a flood of new
identities could take most of a stage's calls before each one is found out. So the peers a trainer
first saw less than ``window_s`` ago (newcomers), together, take at most ``max_share`` of the
stage's recent calls whenever a peer known for longer can take the call instead. A newcomer that
stays past the window is a peer like the others.

Peers present at the trainer's first look at the stage (the first that finds any) are not newcomers: the trainer has nothing older to
prefer, and an honest swarm must run at full speed from the start. A stage whose only replicas are
newcomers uses them.

Pure: no I/O, no asyncio, time only from the injected clock.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable


class NewcomerCap:
    """Newcomers' share of one stage's calls.

    window_s: seconds after its first sighting during which a peer is a newcomer.
    max_share: the largest fraction of the last ``recent_calls`` calls newcomers may take, in (0, 1].
    recent_calls: how many of the stage's latest calls the share is measured over.
    max_peers: sightings remembered; the oldest is forgotten first (a forgotten peer that comes
        back is a newcomer again).
    clock: seconds, monotonic.
    """

    def __init__(
        self,
        *,
        window_s: float = 300.0,
        max_share: float = 0.5,
        recent_calls: int = 100,
        max_peers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(window_s) and window_s >= 0.0):
            raise ValueError(f"window_s must be a finite number of seconds >= 0, got {window_s}")
        if not 0.0 < max_share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        if recent_calls < 1 or max_peers < 1:
            raise ValueError(f"recent_calls and max_peers must be at least 1, got {recent_calls}, {max_peers}")
        self._window_s, self._max_share, self._max_peers = window_s, max_share, max_peers
        self._clock = clock
        self._first_seen_s: OrderedDict[str, float] = OrderedDict()
        self._founders: set[str] | None = None  # peers of the first sighting: never newcomers
        self._recent: deque[bool] = deque(maxlen=recent_calls)  # was each recent call a newcomer's?

    def saw(self, peer_ids: Iterable[str]) -> None:
        """The stage's replicas, as just read from the DHT."""
        now_s = self._clock()
        peers = list(peer_ids)
        if self._founders is None and peers:
            self._founders = set(peers)
        for peer in peers:
            if peer not in self._first_seen_s:
                self._first_seen_s[peer] = now_s
        while len(self._first_seen_s) > self._max_peers:
            forgotten, _ = self._first_seen_s.popitem(last=False)
            self._founders.discard(forgotten)

    def is_newcomer(self, peer_id: str) -> bool:
        if self._founders is not None and peer_id in self._founders:
            return False
        first_s = self._first_seen_s.get(peer_id)
        return first_s is None or self._clock() - first_s < self._window_s

    def share(self) -> float:
        """Newcomers' fraction of the recent calls."""
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    def excluded(self, candidates: Collection[str]) -> set[str]:
        """Newcomers among `candidates` to leave out of the next call: all of them while their share
        is at the cap and a peer known for longer is among the candidates; none otherwise."""
        newcomers = {p for p in candidates if self.is_newcomer(p)}
        if not newcomers or len(newcomers) == len(candidates):
            return set()
        return newcomers if self.share() >= self._max_share else set()

    def called(self, peer_id: str) -> None:
        """A call of this stage went to `peer_id`."""
        self._recent.append(self.is_newcomer(peer_id))
