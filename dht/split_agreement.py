"""One split per swarm: reading and stating split records, and the rules that decide which split
is in force.

Rules (pure functions below): the split in force is the one of the earliest active claim; active
claims that disagree are a conflict (a trainer refuses to run on them). A peer that asks for
another split than the one in force refuses to start; one that asks for none adopts it. Two peers
that state different splits at the same moment both see each other once their claims are
stored: the later claim (by `since`, then peer id) withdraws.
"""

from __future__ import annotations

import hivemind

from dht.keys import peer_subkey, split_key
from dht.records import SplitRecord, parse_split_records
from dht.signing import allowed_peers_of, identity_of, owned_entries
from dht.subkey_records import await_store, lookup, lookup_async, restamping_store, wait_store


class SplitConflictError(RuntimeError):
    """The split a process asked for (or found) disagrees with the swarm's; the message says how."""


# --- the rules -----------------------------------------------------------------------------------


def _claim_order(record: SplitRecord) -> tuple[float, str]:
    return record.since, record.peer_id


def active_claims(records: list[SplitRecord], *, excluding: str | None = None) -> list[SplitRecord]:
    """Claims of peers still in the swarm, earliest first (optionally not counting one peer's own)."""
    return sorted((r for r in records if r.active and r.peer_id != excluding), key=_claim_order)


def split_in_force(records: list[SplitRecord], *, excluding: str | None = None) -> SplitRecord | None:
    """The earliest active claim, or None if nobody claims a split; `SplitConflictError` if the
    active claims name different splits."""
    claims = active_claims(records, excluding=excluding)
    if not claims:
        return None
    first = claims[0]
    for other in claims[1:]:
        if not other.same_split(first):
            raise SplitConflictError(
                f"peers of {first.model} disagree on the split: peer {first.peer_id[-8:]} serves {first.describe()}, "
                f"peer {other.peer_id[-8:]} serves {other.describe()}; stop the peers of one of them"
            )
    return first


def choose_split(
    requested: tuple[int, ...] | None,
    num_stages: int,
    default: tuple[int, ...],
    in_force: SplitRecord | None,
    model: str,
) -> tuple[int, ...]:
    """The boundaries a starting peer serves: the ones it asked for, or the swarm's, or `default`
    (the equal split) when neither is known. Raises `SplitConflictError` on a disagreement."""
    if in_force is None:
        return requested if requested is not None else default
    flag = f"--num-stages {in_force.num_stages} --split-boundaries {','.join(map(str, in_force.boundaries))}"
    if requested is None and in_force.num_stages != num_stages:
        raise SplitConflictError(
            f"the swarm serves {model} in {in_force.describe()}, this peer asked for "
            f"{num_stages} stages; start it with {flag} (or without --split-boundaries)"
        )
    if requested is not None and (in_force.num_stages, in_force.boundaries) != (num_stages, requested):
        raise SplitConflictError(
            f"the swarm serves {model} in {in_force.describe()}, this peer asked for "
            f"block boundaries {','.join(map(str, requested))}; a swarm never mixes two "
            f"splits: start it with {flag}, or leave --split-boundaries out to adopt the swarm's"
        )
    return in_force.boundaries


def earlier_conflicting_claim(mine: SplitRecord, records: list[SplitRecord]) -> SplitRecord | None:
    """An active claim of another peer that names another split and was made before `mine`."""
    for other in active_claims(records, excluding=mine.peer_id):
        if not other.same_split(mine) and _claim_order(other) < _claim_order(mine):
            return other
    return None


# --- DHT I/O -------------------------------------------------------------------------------------


def _store(dht: hivemind.DHT, record: SplitRecord):
    identity = identity_of(dht)
    if record.peer_id != identity.peer_id:
        raise ValueError(f"this node is {identity.peer_id} and can only state its own split, not {record.peer_id}")
    return restamping_store(dht, split_key(record.model), peer_subkey(record.peer_id, identity.owner_marker), record)


def _parse(dht: hivemind.DHT, entries: dict, model: str) -> list[SplitRecord]:
    owned = owned_entries(entries, what=f"{model} split", allowed=allowed_peers_of(dht))
    return parse_split_records(owned, model=model)


def publish_split(dht: hivemind.DHT, record: SplitRecord, *, timeout_s: float = 10.0) -> bool:
    """Store `record` (blocking). Returns whether it was stored."""
    return wait_store(_store(dht, record), timeout_s=timeout_s, what=f"Stating the split of {record.model}")


async def publish_split_async(dht: hivemind.DHT, record: SplitRecord, *, timeout_s: float = 10.0) -> bool:
    return await await_store(_store(dht, record), timeout_s=timeout_s, what=f"Stating the split of {record.model}")


def fetch_split_records(dht: hivemind.DHT, model: str, *, timeout_s: float = 10.0) -> list[SplitRecord]:
    """Every unexpired split record of a model (blocking; malformed entries are skipped)."""
    return _parse(dht, lookup(dht, split_key(model), timeout_s=timeout_s), model)


async def fetch_split_records_async(dht: hivemind.DHT, model: str, *, timeout_s: float = 10.0) -> list[SplitRecord]:
    """Every unexpired split record of a model; [] (with a warning) when the lookup times out."""
    entries = await lookup_async(dht, split_key(model), timeout_s=timeout_s, what=f"the split of {model}")
    return _parse(dht, entries or {}, model)
