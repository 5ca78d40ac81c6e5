"""Move claims on the DHT: a peer about to make a rebalancing move states it first.

Each peer keeps at most one `MoveClaim` under `moves_key(model)` (subkey: its own peer id,
signed), short-lived; it withdraws it (`active=False`) when it lost the race, and lets the claim
of a move it made lapse (peers/placement/rebalance.py says why).
Who may move is decided over the claims read back, by the pure rule
`peers.placement.rebalance.claim_verdict`; peers/placement/stage_moves.py makes the moves.
"""

from __future__ import annotations

import hivemind
from hivemind.utils import get_dht_time

from dht.keys import moves_key, peer_subkey
from dht.records import MoveClaim, parse_move_claims
from dht.signing import allowed_peers_of, identity_of, owned_entries
from dht.subkey_records import await_store, lookup_async, restamping_store


async def publish_move_claim_async(dht: hivemind.DHT, claim: MoveClaim, *, timeout_s: float = 5.0) -> bool:
    """Store `claim` (or its withdrawal) for the lifetime its `expires_at` gives it. Returns whether
    it was stored."""
    identity = identity_of(dht)
    if claim.peer_id != identity.peer_id:
        raise ValueError(f"this node is {identity.peer_id} and can only state its own move claim, not {claim.peer_id}")

    store = restamping_store(dht, moves_key(claim.model), peer_subkey(claim.peer_id, identity.owner_marker), claim)

    what = f"Claiming the move from stage {claim.from_stage} to {claim.to_stage}"
    return await await_store(store, timeout_s=timeout_s, what=what)


async def fetch_move_claims_async(dht: hivemind.DHT, model: str, *, timeout_s: float = 5.0) -> list[MoveClaim] | None:
    """Every well-formed, unexpired move claim of `model` (withdrawn ones included: the rule skips
    them), or None (with a warning) when the lookup times out: a caller that cannot see the other
    claims must not take itself for the winner."""
    entries = await lookup_async(dht, moves_key(model), timeout_s=timeout_s, what=f"the move claims of {model}")
    if entries is None:
        return None
    owned = owned_entries(entries, what=f"{model} move claims", allowed=allowed_peers_of(dht))
    now = get_dht_time()
    return [c for c in parse_move_claims(owned, model=model) if c.expires_at > now]
