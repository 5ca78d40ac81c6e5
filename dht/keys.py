"""Every DHT key and subkey format, in one place."""

from __future__ import annotations


def stage_key(model: str, stage: int) -> str:
    """The key under which every replica of one stage announces itself (subkey: its peer id)."""
    return f"swarm/{model}/stage/{stage}"


def peer_subkey(peer_id: str) -> str:
    return peer_id
