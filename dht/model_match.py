"""Peers of different models never mix: a process compares its model's fingerprint
(models/identity.py) with the ones the live peers of its model name announce, and is refused in one
line when they differ. Records that state no fingerprint ('' : older peers) are not judged."""

from __future__ import annotations

from collections.abc import Iterable

from dht.records import PeerRecord


class ModelMismatchError(ValueError):
    """This process's model is not the one the live peers of the same name serve."""


def foreign_records(records: Iterable[PeerRecord], model_hash: str) -> list[PeerRecord]:
    """The records whose stated fingerprint differs from `model_hash` ('' on either side: no judgement)."""
    if not model_hash:
        return []
    return [r for r in records if r.model_hash and r.model_hash != model_hash]


def check_same_model(records: Iterable[PeerRecord], model_hash: str, *, model: str, who: str) -> None:
    """Raise ModelMismatchError when a live peer of `model` announces another fingerprint."""
    foreign = foreign_records(records, model_hash)
    if foreign:
        theirs = sorted({r.model_hash for r in foreign})
        raise ModelMismatchError(
            f"this {who}'s model {model!r} (hash {model_hash}) differs from the one {len(foreign)} live peer(s) "
            f"serve (hash {', '.join(theirs)}); use the same --model / --model-dir as the swarm, or another --model name"
        )
