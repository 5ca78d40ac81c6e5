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


def save_checkpoint(path: str, meta: CheckpointMeta, module_state: dict, optimizer_state: dict) -> None:
    buffer = io.BytesIO()
    torch.save({"meta": meta.__dict__, "module": module_state, "optimizer": optimizer_state}, buffer)
    payload = buffer.getvalue()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path: str) -> tuple[CheckpointMeta, dict, dict]:
    """(meta, module state, optimizer state); raises CheckpointError for anything damaged."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path!r}: {e.strerror}") from None
    if len(data) < len(MAGIC) + 32 or not data.startswith(MAGIC):
        raise CheckpointError(f"{path!r} is not a swarm checkpoint (or is truncated)")
    digest, payload = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path!r} is corrupted or truncated (checksum mismatch); refusing to load it")
    try:
        content = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        meta = CheckpointMeta(**content["meta"])
        return meta, content["module"], content["optimizer"]
    except Exception as e:
        raise CheckpointError(f"checkpoint {path!r} has an unexpected layout: {e}") from None
