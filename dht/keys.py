"""Every DHT key and subkey format, in one place."""

from __future__ import annotations

import re

OWNER_PREFIX, OWNER_SUFFIX = b"[owner:", b"]"  # hivemind's RSASignatureValidator marker
_OWNED_SUBKEY = re.compile(rb"([1-9A-HJ-NP-Za-km-z]{1,128})\[owner:(.+?)\]", re.DOTALL)


def stage_key(model: str, stage: int) -> str:
    """The key under which every replica of one stage announces itself (subkey: `peer_subkey`)."""
    return f"swarm/{model}/stage/{stage}"


def peer_subkey(peer_id: str, owner_marker: bytes) -> bytes:
    """`<peer id>[owner:<RSA public key>]`: only the holder of that key can write under this subkey
    (hivemind's RSASignatureValidator), and readers check the key hashes to the peer id
    (dht/signing.py)."""
    return peer_id.encode() + owner_marker


def parse_peer_subkey(subkey) -> tuple[str, bytes] | None:
    """(peer id, public key bytes) of a `peer_subkey`, or None for anything else (an old unsigned
    subkey, garbage)."""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNED_SUBKEY.fullmatch(subkey)
    if match is None:
        return None
    return match.group(1).decode(), match.group(2)


def split_key(model: str) -> str:
    """The key under which every peer of a model states the stage split it serves (subkey:
    `peer_subkey`), so that peers and trainers agree on one split."""
    return f"swarm/{model}/split"


def links_key(model: str) -> str:
    """The key under which every peer of a model publishes its measured links to other peers
    (subkey: its peer id), read by `swarm plan --from-dht`."""
    return f"swarm/{model}/links"


def progress_key(model: str) -> str:
    """The key under which trainers of a model state their progress through the run's global step
    (subkey: `peer_subkey` of the trainer; dht/trainer_progress.py)."""
    return f"swarm/{model}/progress"


def moves_key(model: str) -> str:
    """The key under which peers of a model claim a rebalancing move before making it (subkey:
    `peer_subkey`; dht/move_claims.py), so that two peers that each planned to move agree on one."""
    return f"swarm/{model}/moves"


def plan_key(model: str) -> str:
    """The key under which `swarm plan --publish` stores placement plans (subkey: the planner's
    peer id; the newest unexpired plan is the current one)."""
    return f"swarm/{model}/plan"


def runs_key() -> str:
    """The key under which every peer announces the signed spec of the run it serves (subkey:
    `peer_subkey`; dht/run_specs.py), so that a process that knows only an address finds its run."""
    return "swarm/runs"
