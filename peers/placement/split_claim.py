"""A starting peer's claim on the model's stage split: decide the boundaries it serves from its
flag and the swarm's split records, state them on the DHT, and refuse to start on a conflict
(the rules are in `dht.split_agreement`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import hivemind
from hivemind.utils import get_dht_time

from dht.records import SplitRecord
from dht.split_agreement import (
    SplitConflictError,
    choose_split,
    earlier_conflicting_claim,
    fetch_split_records,
    publish_split,
    split_in_force,
)
from models.stages import equal_boundaries

logger = logging.getLogger(__name__)


def claim_split(
    dht: hivemind.DHT,
    *,
    model: str,
    peer_id: str,
    requested: tuple[int, ...] | None,
    num_stages: int,
    n_layers: int,
    ttl_s: float,
    timeout_s: float = 10.0,
    claimants: Collection[str] | None = None,
) -> SplitRecord:
    """The split this peer will serve, already stated on the DHT. Raises `SplitConflictError`.
    `claimants`: the peers whose claims count (a run's members: a stranger's early claim of another
    split would otherwise make every new peer refuse to start); None: every peer's."""

    def counted(records):
        return records if claimants is None else [r for r in records if r.peer_id in claimants]

    try:
        in_force = split_in_force(counted(fetch_split_records(dht, model, timeout_s=timeout_s)), excluding=peer_id)
    except TimeoutError:
        raise SplitConflictError(f"could not read the split of {model} from the DHT within {timeout_s} s") from None
    boundaries = choose_split(requested, num_stages, equal_boundaries(n_layers, num_stages), in_force, model)
    now = get_dht_time()
    mine = SplitRecord(
        peer_id=peer_id,
        model=model,
        num_stages=len(boundaries) - 1,
        boundaries=tuple(boundaries),
        since=now,
        expires_at=now + ttl_s,
    )
    mine = _publish_with_retries(dht, mine, ttl_s=ttl_s, timeout_s=timeout_s)
    if mine is None:
        raise SplitConflictError(
            f"could not state this peer's split of {model} on the DHT after "
            f"{len(STORE_RETRY_DELAYS_S) + 1} attempts; is the bootstrap node reachable?"
        )
    # Another peer may have stated a different split between our read and our write: the earlier
    # claim stands, the later one withdraws (both peers apply the same rule to the same records).
    try:
        earlier = earlier_conflicting_claim(mine, counted(fetch_split_records(dht, model, timeout_s=timeout_s)))
    except TimeoutError:
        earlier = None  # our claim is stored; the trainer still checks that the swarm agrees
    if earlier is not None:
        publish_split(dht, renewed(mine, active=False, ttl_s=ttl_s), timeout_s=timeout_s)
        raise SplitConflictError(
            f"peer {earlier.peer_id[-8:]} started serving {model} in {earlier.describe()} "
            f"just before this peer; a swarm never mixes two splits, so this peer stops"
        )
    return mine


STORE_RETRY_DELAYS_S = (1.0, 2.0, 4.0)


def _publish_with_retries(
    dht: hivemind.DHT, claim: SplitRecord, *, ttl_s: float, timeout_s: float
) -> SplitRecord | None:
    """Store `claim`; returns the record stored, or None after the last attempt failed.

    A store can fail while the swarm's nodes are still finding each other (several peers starting
    at once on a loaded machine), so it is tried a few times. Each retry carries a fresh expiry: a
    node that kept an earlier attempt although the store as a whole failed (its answer came too
    late, for instance) refuses the same subkey again unless the new expiry is later (hivemind's
    storage), so retrying the identical record could never succeed (seen in CI: four attempts in a
    row refused)."""
    for attempt, delay_s in enumerate((*STORE_RETRY_DELAYS_S, None), start=1):
        if publish_split(dht, claim, timeout_s=timeout_s):
            return claim
        if delay_s is not None:
            logger.warning(
                f"Stating the split of {claim.model} on the DHT failed (attempt {attempt}); retrying in {delay_s:.0f} s"
            )
            time.sleep(delay_s)
            claim = renewed(claim, active=claim.active, ttl_s=ttl_s)
    return None


def renewed(claim: SplitRecord, *, active: bool, ttl_s: float) -> SplitRecord:
    """The same claim with a fresh expiry (and `active=False` once the peer leaves)."""
    return claim.model_copy(update={"active": active, "expires_at": get_dht_time() + ttl_s})


def split_tag(claim: SplitRecord, n_layers: int) -> str | None:
    """None for the equal split, else the boundaries as a file-name-safe tag (e.g. "0-4-6")."""
    if claim.boundaries == equal_boundaries(n_layers, claim.num_stages):
        return None
    return "-".join(map(str, claim.boundaries))
