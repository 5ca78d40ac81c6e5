"""Bytes on the wire per codec, counted where tensors are sent and received.

Later these totals become Prometheus counters (``swarm_codec_sent_bytes_total{codec=...}``); the
codec label only ever takes registered names, so its cardinality stays bounded even though
headers come from peers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from wire.compression.base import EncodedTensor, UnknownCodecError
from wire.compression.registry import known_codecs


@dataclass
class _Totals:
    tensors: int = 0
    wire_bytes: int = 0  # EncodedTensor.nbytes: the parts' buffers
    original_bytes: int = 0  # what the same tensors take uncompressed in memory


class ByteCounter:
    """Thread-safe totals of tensors and bytes sent and received, per codec name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, _Totals]] = {"sent": {}, "received": {}}

    def _record(self, direction: str, encoded: EncodedTensor) -> None:
        codec = encoded.header.codec
        if codec not in known_codecs():
            raise UnknownCodecError(codec, known_codecs())
        with self._lock:
            totals = self._totals[direction].setdefault(codec, _Totals())
            totals.tensors += 1
            totals.wire_bytes += encoded.nbytes
            totals.original_bytes += encoded.header.original_nbytes

    def record_sent(self, encoded: EncodedTensor) -> None:
        """Count a tensor this process sent."""
        self._record("sent", encoded)

    def record_received(self, encoded: EncodedTensor) -> None:
        """Count a tensor received from a peer; call it after the tensor decoded successfully."""
        self._record("received", encoded)

    def snapshot(self) -> dict:
        """``{"sent": {codec: {"tensors", "wire_bytes", "original_bytes"}}, "received": {...}}``."""
        with self._lock:
            return {
                direction: {codec: vars(totals).copy() for codec, totals in sorted(per_codec.items())}
                for direction, per_codec in self._totals.items()
            }
