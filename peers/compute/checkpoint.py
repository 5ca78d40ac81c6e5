"""Stage checkpoints that are never half-written and never loaded when damaged.

File layout: MAGIC (8 bytes) + sha256 of the payload (32 bytes) + payload (a torch.save of the
stage's parameters, optimizer state and metadata). Writing goes to a temporary file in the same
folder, is fsynced, then renamed over the old checkpoint, so a crash leaves the old file intact.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass

import torch

from process.atomic_files import write_atomically

MAGIC = b"SWRMCKP1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted or belongs to another model or stage."""


@dataclass(frozen=True)
class CheckpointMeta:
    model: str
    stage: int
    num_stages: int
    steps_done: int


def checkpoint_path(folder: str, model: str, stage: int, num_stages: int, split_tag: str | None = None) -> str:
    """`split_tag` names a split other than the equal one, so a stage never loads another split's layers."""
    split = f"-split{split_tag}" if split_tag else ""
    return os.path.join(folder, f"{model}-stage{stage}of{num_stages}{split}.ckpt")


def serialize_state(meta: CheckpointMeta, module_state: dict, optimizer_state: dict) -> bytes:
    """MAGIC + sha256(payload) + payload: the bytes of a checkpoint file, also what a replica sends
    a joining peer."""
    buffer = io.BytesIO()
    torch.save({"meta": meta.__dict__, "module": module_state, "optimizer": optimizer_state}, buffer)
    payload = buffer.getvalue()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def deserialize_state(data: bytes, source: str = "state") -> tuple[CheckpointMeta, dict, dict]:
    """(meta, module state, optimizer state); raises CheckpointError for anything damaged."""
    if len(data) < len(MAGIC) + 32 or not data.startswith(MAGIC):
        raise CheckpointError(f"{source} is not a swarm checkpoint (or is truncated)")
    digest, payload = data[len(MAGIC) : len(MAGIC) + 32], data[len(MAGIC) + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{source} is corrupted or truncated (checksum mismatch); refusing to load it")
    try:
        content = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        return CheckpointMeta(**content["meta"]), content["module"], content["optimizer"]
    except Exception as e:
        raise CheckpointError(f"{source} has an unexpected layout: {e}") from None


def save_checkpoint(path: str, meta: CheckpointMeta, module_state: dict, optimizer_state: dict) -> None:
    write_atomically(path, serialize_state(meta, module_state, optimizer_state), durable=True)


def load_checkpoint(path: str) -> tuple[CheckpointMeta, dict, dict]:
    """(meta, module state, optimizer state); raises CheckpointError for anything damaged."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path!r}: {e.strerror}") from None
    return deserialize_state(data, f"checkpoint {path!r}")
