"""Exporting a run trained with adapters (`--trainable lora:R`, models/lora.py).

Such a run's checkpoints and live snapshots hold only the adapters; the base weights are what every
peer started from: the seed's initial weights, `--init-weights` or the `--model-dir` folder. The
export rebuilds each stage's base the same way, and either merges the adapters into it
(W + scale * B @ A: a plain model, written like any other) or, with `--adapters-only`, writes the
adapters apart (`adapters.safetensors` in the project's names, whole-model block numbering, and
`adapter_config.json` with the rank, scale and the base model's fingerprint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Sequence

import torch
from safetensors.torch import save_file

from models.config import GPTConfig
from models.hf_format import load_stage_from_folder
from models.identity import model_fingerprint
from models.init_weights import InitWeightsError, global_name, load_stage_weights
from models.lora import adapters_only, is_adapter, merge_adapters
from models.stages import build_stage
from swarm.export.assemble import ExportError, StagePart

ADAPTERS_FILE = "adapters.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
SCALE = 1.0  # lora_alpha / R (models/lora.py)


def adapter_rank(parts: dict[int, StagePart]) -> int | None:
    """The LoRA rank of the parts' adapters, or None when they hold full weights."""
    ranks = {
        int(t.shape[0]) for p in parts.values() for name, t in p.state.items() if ".lora_A." in name and t.dim() == 2
    }
    if not ranks:
        return None
    if len(ranks) > 1:
        raise ExportError(f"the stages hold adapters of different ranks ({sorted(ranks)}): not one run")
    if any(not is_adapter(name) for p in parts.values() for name in p.state):
        raise ExportError("a stage holds adapters and full weights at once: not one run")
    return ranks.pop()


def base_stage_state(
    config: GPTConfig,
    stage: int,
    boundaries: Sequence[int],
    *,
    seed: int,
    model_dir: str | None,
    init_weights: str | None,
) -> dict[str, torch.Tensor]:
    """The weights a peer of this stage started from, in the stage's local names."""
    base_config = dataclasses.replace(config, trainable="all")
    module = build_stage(base_config, stage, len(boundaries) - 1, seed, tuple(boundaries))
    if model_dir:
        load_stage_from_folder(module, model_dir)
    elif init_weights:
        try:
            load_stage_weights(module, init_weights)
        except InitWeightsError as e:
            raise ExportError(str(e)) from None
    return {name: t.detach() for name, t in module.state_dict().items()}


def merge_parts(
    config: GPTConfig,
    parts: dict[int, StagePart],
    boundaries: Sequence[int],
    *,
    seed: int,
    model_dir: str | None,
    init_weights: str | None,
) -> dict[int, StagePart]:
    """Each stage's base weights with its adapters merged in: parts that hold full weights."""
    merged = {}
    for stage, part in parts.items():
        base = base_stage_state(config, stage, boundaries, seed=seed, model_dir=model_dir, init_weights=init_weights)
        try:
            state = merge_adapters(base, part.state, scale=SCALE)
        except KeyError as e:
            raise ExportError(f"stage {stage} ({part.source}): {e.args[0]}: adapters of another model?") from None
        merged[stage] = dataclasses.replace(part, state=state)
    return merged


def write_adapters(
    config: GPTConfig, parts: dict[int, StagePart], boundaries: Sequence[int], rank: int, out: str, *, overwrite: bool
) -> str:
    """`--adapters-only`: the adapters of every stage, in whole-model names, into `out` (atomically)."""
    out = os.path.normpath(out)
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out!r} already exists; choose another --out or pass --overwrite")
    tensors = {
        global_name(name, boundaries[stage]): t.detach().contiguous().cpu()
        for stage, part in parts.items()
        for name, t in adapters_only(part.state).items()
    }
    base = dataclasses.replace(config, trainable="all")
    meta = {
        "format": "swarm-lora",
        "r": rank,
        "lora_alpha": rank,
        "scale": SCALE,
        "target": "every nn.Linear inside the blocks",
        "base_model": config.name,
        "base_fingerprint": model_fingerprint(base),
        "merge": "W + scale * B @ A for each <layer>.weight (models/lora.py merge_adapters)",
    }
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.adapters.", dir=parent)
    try:
        save_file(tensors, os.path.join(staging, ADAPTERS_FILE), metadata={"format": "pt"})
        with open(os.path.join(staging, ADAPTER_CONFIG_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
