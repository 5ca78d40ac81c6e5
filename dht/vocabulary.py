"""The vocabulary is part of the model: peers announce theirs (`PeerRecord.vocab_size`), and a
trainer or joining peer whose vocabulary differs from the swarm's refuses in one line."""

from __future__ import annotations

from collections.abc import Iterable

from dht.records import PeerRecord, PeerState


class VocabularyMismatchError(RuntimeError):
    """This process's vocabulary differs from the one the swarm's peers serve."""


def swarm_vocabulary(records: Iterable[PeerRecord]) -> tuple[int, str] | None:
    """(vocabulary, a peer stating it) of the live peers that state one; None if none does."""
    for record in records:
        if record.vocab_size and record.state in (PeerState.ONLINE, PeerState.JOINING, PeerState.STANDBY):
            return record.vocab_size, record.peer_id
    return None


def check_vocabulary(records: Iterable[PeerRecord], vocab_size: int, *, model: str, mine: str) -> None:
    """Raise VocabularyMismatchError if a live peer of `model` serves another vocabulary than
    `vocab_size` (`mine` says where ours comes from, for the message)."""
    for record in records:
        if record.vocab_size and record.vocab_size != vocab_size and record.state != PeerState.OFFLINE:
            raise VocabularyMismatchError(
                f"the swarm serves {model} with a vocabulary of {record.vocab_size} tokens (peer "
                f"{record.peer_id[-8:]}), {mine} has {vocab_size}"
            )
