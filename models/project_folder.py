"""Model folders in the project's own format, and loading any exported folder.

A Hugging Face folder (config.json, models/hf_format.py) holds what transformers has a class for.
Two kinds of models have none, and `swarm export` writes them in the project's own format instead:

    model.safetensors   the whole model's tensors in the project's naming (what `--init-weights`
                        reads: `embedding.*`, `blocks.<i>.*`, `head.*`, `boundary_down.<b>.*`, ...)
    swarm.json          {"config": the exact GPTConfig, "boundaries": the split, ...the export's metadata}

- a user architecture (`--model module:function`, models/interface.py);
- a learned-subspace model (models/subspace.py): its boundary projections and token anchors sit at
  the split's boundaries, so the folder names the split and the model is rebuilt for it.

`load_model_folder` reads either kind of folder (what `swarm generate` uses).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.config import GPTConfig
from models.hf_format import CONFIG_FILE, SWARM_META_FILE, WEIGHTS_FILE, ModelFolderError, read_model_folder
from models.stages import StageModule, build_full_model


def needs_project_folder(config: GPTConfig) -> bool:
    """Whether transformers has no class for this model (it is exported in the project's format)."""
    return config.arch == "user" or (config.subspace_rank > 0 and config.subspace_kind == "learned")


def write_project_folder(
    config: GPTConfig, state: dict[str, torch.Tensor], folder: str, *, boundaries: Sequence[int], extra_meta: dict
) -> str:
    """`model.safetensors` in the project's tensor naming and `swarm.json` (the config, the split's
    `boundaries`, and `extra_meta`), into a new `folder`."""
    os.makedirs(folder)
    tensors = {name: t.detach().cpu().contiguous() for name, t in state.items()}
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, SWARM_META_FILE), "w") as f:
        json.dump({**extra_meta, "config": config.to_dict(), "boundaries": list(boundaries)}, f, indent=2)
        f.write("\n")
    return folder


def read_project_folder(folder: str) -> tuple[GPTConfig, StageModule]:
    """The config and the whole model of a folder `write_project_folder` wrote; ModelFolderError
    (one line) for a folder that is not one."""
    meta_path, weights_path = os.path.join(folder, SWARM_META_FILE), os.path.join(folder, WEIGHTS_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        fields = dict(meta["config"])
        if fields.get("part_parameters") is not None:
            fields["part_parameters"] = tuple(fields["part_parameters"])
        config = GPTConfig(**fields)
        boundaries = meta.get("boundaries")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFolderError(f"{folder!r}: {SWARM_META_FILE} does not describe a model ({e})") from None
    model = build_full_model(config, boundaries=boundaries)
    try:
        state = load_file(weights_path)
    except (OSError, SafetensorError) as e:
        raise ModelFolderError(f"{folder!r}: {WEIGHTS_FILE} is not readable ({e})") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ModelFolderError(
            f"{folder!r}: the weights do not fit the model {SWARM_META_FILE} describes ({e})"
        ) from None
    return config, model


def load_model_folder(folder: str) -> tuple[GPTConfig, StageModule]:
    """The whole model of an exported folder: a Hugging Face folder (config.json) or one in the
    project's own format (swarm.json and no config.json)."""
    is_project = not os.path.isfile(os.path.join(folder, CONFIG_FILE)) and os.path.isfile(
        os.path.join(folder, SWARM_META_FILE)
    )
    return read_project_folder(folder) if is_project else read_model_folder(folder)
