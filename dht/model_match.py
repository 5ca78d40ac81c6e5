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


class VocabularyMismatchError(ModelMismatchError):
    """This process's vocabulary is not the one the live peers of the model serve."""


def check_same_vocabulary(records: Iterable[PeerRecord], vocab_size: int, *, model: str, who: str, mine: str) -> None:
    """Raise VocabularyMismatchError naming both sizes when a live peer of `model` announces another
    vocabulary (records stating none, 0, are not judged). `mine` says where ours comes from."""
    theirs = sorted({r.vocab_size for r in records if r.vocab_size and r.vocab_size != vocab_size})
    if theirs:
        raise VocabularyMismatchError(
            f"this {who}'s {mine} has a vocabulary of {vocab_size} tokens, but the swarm serving {model!r} has "
            f"{', '.join(map(str, theirs))}: prepare the data with the swarm's tokenizer, or start peers with "
            f"--vocab-size {vocab_size}"
        )


def check_same_model(records: Iterable[PeerRecord], model_hash: str, *, model: str, who: str) -> None:
    """Raise ModelMismatchError when a live peer of `model` announces another fingerprint."""
    foreign = foreign_records(records, model_hash)
    if foreign:
        theirs = sorted({r.model_hash for r in foreign})
        raise ModelMismatchError(
            f"this {who}'s model {model!r} (hash {model_hash}) differs from the one {len(foreign)} live peer(s) "
            f"serve (hash {', '.join(theirs)}); use the same --model / --model-dir as the swarm, or another --model name"
        )
