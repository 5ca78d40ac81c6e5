"""Peers of different models never mix: a process compares its model's fingerprint
(models/identity.py) with the ones the live peers of its model name announce. Records that state no
fingerprint ('' : older peers) are not judged.

A record of another model never becomes the swarm's model (issue #60: one such record on stage 0's
key made every new trainer exit and every new peer refuse to start, in a private run too). A process
is refused, in one line, only when it is the odd one out: the records that judge it announce another
fingerprint and none announces its own. Other foreign records are skipped, counted, with a warning.
The records that judge (`judging_records`): in a private run, its members' (a peer credential of the
run in the record, which the record's own signature binds to its peer); in an open run, the
credentialed ones when the process holds a credential or any record carries one; else all.
Not defended: in a swarm with no run, or for a process of an open run without a credential while no
record carries one, a stranger's record that is there first makes an honest process the odd one out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dht.authority import RunAuthority, credentialed_records
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


def check_same_vocabulary(
    records: Iterable[PeerRecord],
    vocab_size: int,
    *,
    model: str,
    who: str,
    mine: str,
    authority: RunAuthority | None = None,
    credentialed: bool = False,
) -> None:
    """Raise VocabularyMismatchError naming both sizes when this process is the odd one out: the
    records that judge it (`judging_records`) announce another vocabulary and none announces ours
    (records stating none, 0, are not judged). `mine` says where ours comes from."""
    judging = judging_records(list(records), authority, credentialed=credentialed)
    theirs = sorted({r.vocab_size for r in judging if r.vocab_size and r.vocab_size != vocab_size})
    if theirs and not any(r.vocab_size == vocab_size for r in judging):
        raise VocabularyMismatchError(
            f"this {who}'s {mine} has a vocabulary of {vocab_size} tokens, but the swarm serving {model!r} has "
            f"{', '.join(map(str, theirs))}: prepare the data with the swarm's tokenizer, or start peers with "
            f"--vocab-size {vocab_size}"
        )


def judging_records(
    records: Sequence[PeerRecord], authority: RunAuthority | None = None, *, credentialed: bool = False
) -> list[PeerRecord]:
    """The records whose fingerprints judge a process's model (see the module's docstring);
    `credentialed`: the process holds a credential of the run."""
    records = list(records)
    if authority is None:
        return records
    members = [r for r in records if credentialed_records([r], authority, stage=r.stage)]
    if authority.private or credentialed or members:
        return members
    return records


def check_same_model(
    records: Iterable[PeerRecord],
    model_hash: str,
    *,
    model: str,
    who: str,
    authority: RunAuthority | None = None,
    credentialed: bool = False,
) -> list[PeerRecord]:
    """Raise ModelMismatchError when this process is the odd one out: the records that judge it
    (`judging_records`) announce another fingerprint and none announces `model_hash`. Otherwise the
    foreign records, which the caller skips (and counts, and warns of)."""
    records = list(records)
    foreign = foreign_records(records, model_hash)
    judging = judging_records(records, authority, credentialed=credentialed)
    judged_foreign = foreign_records(judging, model_hash)
    if model_hash and judged_foreign and not any(r.model_hash == model_hash for r in judging):
        theirs = sorted({r.model_hash for r in judged_foreign})
        raise ModelMismatchError(
            f"this {who}'s model {model!r} (hash {model_hash}) differs from the one {len(judged_foreign)} live "
            f"peer(s) serve (hash {', '.join(theirs)}); use the same --model / --model-dir as the swarm, or "
            f"another --model name"
        )
    return foreign


def describe_foreign(foreign: Sequence[PeerRecord]) -> str:
    """One line for the warning that skips `foreign` records."""
    hashes = sorted({r.model_hash for r in foreign})
    peers = sorted({r.peer_id[-8:] for r in foreign})
    return (
        f"skipping {len(foreign)} record(s) of {len(peers)} peer(s) that announce another model "
        f"(hash {', '.join(hashes)}: {', '.join(peers[:4])}{'...' if len(peers) > 4 else ''})"
    )
