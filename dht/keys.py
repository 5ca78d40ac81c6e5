"""Every DHT key and subkey format, in one place."""

from __future__ import annotations


def stage_key(model: str, stage: int) -> str:
    """The key under which every replica of one stage announces itself (subkey: its peer id)."""
    return f"swarm/{model}/stage/{stage}"


def peer_subkey(peer_id: str) -> str:
    return peer_id


def split_key(model: str) -> str:
    """The key under which every peer of a model states the stage split it serves (subkey: its
    peer id), so that peers and trainers agree on one split."""
    return f"swarm/{model}/split"


def links_key(model: str) -> str:
    """The key under which every peer of a model publishes its measured links to other peers
    (subkey: its peer id), read by `swarm plan --from-dht`."""
    return f"swarm/{model}/links"


def plan_key(model: str) -> str:
    """The key under which `swarm plan --publish` stores placement plans (subkey: the planner's
    peer id; the newest unexpired plan is the current one)."""
    return f"swarm/{model}/plan"
