"""Calls and bytes per transport, counted where each carries them, for a process's metrics.

"direct" is the data plane (wire/data_plane.py), "p2pd" hivemind's streams (wire/bounded_streams.py,
wire/transport.py). The data plane counts every frame's bytes on its connections; p2pd each
message's serialized protobuf. Neither reads a tensor part's buffer to count it (that copies it).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

TRANSPORTS = ("direct", "p2pd")


class TransportStats:
    """Calls and bytes per transport ("direct", "p2pd"): calls `made` and `served`, and the bytes
    `sent` and `received` as each transport frames them (a message's protobuf for p2pd; every frame
    on the data plane's connections, hellos included, TLS's own bytes not). Counted on the event
    loop, read from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: collections.Counter = collections.Counter()
        self._bytes: collections.Counter = collections.Counter()

    def call(self, transport: str, side: str, rpc: str) -> None:
        """One call of `rpc` (its name, "swarm." left out) made or served over `transport`."""
        with self._lock:
            self._calls[transport, side, rpc.removeprefix("swarm.")] += 1

    def add_bytes(self, transport: str, direction: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[transport, direction] += nbytes

    def message(self, transport: str, direction: str, message: Any) -> None:
        """A protobuf message as p2pd carries it (its serialized size; no buffer is copied to count it)."""
        self.add_bytes(transport, direction, message.ByteSize())

    def snapshot(self) -> dict:
        """{"calls": {(transport, side, rpc): n}, "bytes": {(transport, direction): n}}"""
        with self._lock:
            return {"calls": dict(self._calls), "bytes": dict(self._bytes)}
