"""Stages from peers' checkpoint folders (`--checkpoint-dir`, peers/compute/checkpoint.py).

A peer saves its stage as `<model>-stage<i>of<n>[-split<b0-b1-..>].ckpt`; the name says the model,
the stage and the split, the file's metadata says them again and its checksum guards the rest. Every
file of the model in the given folders is read; a folder with no checkpoint of the model, files of
two different splits, and a damaged file are refused in one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from models.stages import equal_boundaries
from peers.compute.checkpoint import CheckpointError, load_checkpoint
from swarm.export.assemble import ExportError, StagePart, agreed_part

_CHECKPOINT = re.compile(r"^(?P<model>.+)-stage(?P<stage>\d+)of(?P<n>\d+)(?:-split(?P<split>\d+(?:-\d+)+))?\.ckpt$")


def parse_checkpoint_name(filename: str) -> tuple[str, int, int, tuple[int, ...] | None] | None:
    """(model, stage, num_stages, boundaries or None for the equal split), or None for another file."""
    match = _CHECKPOINT.match(filename)
    if match is None:
        return None
    split = match.group("split")
    boundaries = tuple(int(b) for b in split.split("-")) if split else None
    return match.group("model"), int(match.group("stage")), int(match.group("n")), boundaries


def find_checkpoints(folders: Sequence[str], model: str) -> list[tuple[str, int, int, tuple[int, ...] | None]]:
    """(path, stage, num_stages, boundaries) of every checkpoint of `model` in `folders`."""
    found = []
    for folder in folders:
        if not os.path.isdir(folder):
            raise ExportError(f"--checkpoint-dir {folder!r}: no such folder")
        names = sorted(os.listdir(folder))
        parsed = [(name, parse_checkpoint_name(name)) for name in names]
        mine = [(name, p) for name, p in parsed if p is not None and p[0] == model]
        if not mine:
            others = sorted({p[0] for _, p in parsed if p is not None})
            held = f"checkpoints of {', '.join(others)}" if others else "no checkpoint"
            raise ExportError(f"--checkpoint-dir {folder!r} holds no checkpoint of model {model} ({held})")
        found += [(os.path.join(folder, name), stage, n, bounds) for name, (_, stage, n, bounds) in mine]
    return found


def read_checkpoint_parts(
    folders: Sequence[str], model: str, n_layers: int
) -> tuple[dict[int, list[StagePart]], tuple[int, ...]]:
    """Every replica's copy of every stage found, by stage, and the split their names give."""
    found = find_checkpoints(folders, model)
    splits = {(n, bounds or equal_boundaries(n_layers, n)) for _, _, n, bounds in found}
    if len(splits) != 1:
        described = "; ".join(f"{n} stages at {','.join(map(str, b))}" for n, b in sorted(splits))
        raise ExportError(f"the checkpoint folders hold stages of different splits ({described}); give one split's")
    ((num_stages, boundaries),) = splits
    parts: dict[int, list[StagePart]] = {}
    for path, stage, n, _ in found:
        meta, module_state, optimizer_state = load_checkpoint(path)  # CheckpointError for a damaged file
        if (meta.model, meta.stage, meta.num_stages) != (model, stage, n):
            raise CheckpointError(
                f"checkpoint {path!r} holds {meta.model} stage {meta.stage}/{meta.num_stages}, not what its name says"
            )
        module_state, source = agreed_part(module_state, optimizer_state, path)
        parts.setdefault(stage, []).append(StagePart(stage, n, meta.steps_done, module_state, source))
    return parts, boundaries
