"""Initial weights from a local safetensors file (never a hub): the whole model's tensors, of which
each stage reads only its own slice.

Names are those of `build_full_model(config).state_dict()`: `embedding.*`, `blocks.<i>.*` with the
global block index, `head.*`. A stage holding blocks a..b-1 reads `blocks.a.*`..`blocks.<b-1>.*`
and renames them to its local `blocks.0.*`.. Tensors are read lazily, so a stage of a big model
never loads the rest.
"""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models.stages import StageModule


class InitWeightsError(ValueError):
    """The initial-weights file is missing, unreadable, or does not fit the stage."""


def global_name(local_name: str, first_layer: int) -> str:
    """`blocks.0.attn.qkv.weight` of a stage starting at block 4 -> `blocks.4.attn.qkv.weight`."""
    if not local_name.startswith("blocks."):
        return local_name
    _, index, rest = local_name.split(".", 2)
    return f"blocks.{int(index) + first_layer}.{rest}"


def load_stage_weights(module: StageModule, path: str) -> int:
    """Copy this stage's tensors from `path` into `module` (in place); returns how many were loaded.
    Raises InitWeightsError naming the first missing or mis-shaped tensor."""
    if not os.path.isfile(path):
        raise InitWeightsError(f"--init-weights {path!r}: no such file")
    wanted = module.state_dict()
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            available = set(f.keys())
            loaded = {}
            for local, target in wanted.items():
                name = global_name(local, module.spec.first_layer)
                if name not in available:
                    raise InitWeightsError(
                        f"--init-weights {path!r} has no tensor {name!r} (needed by stage "
                        f"{module.spec.index}); is it a {module.config.name} model?"
                    )
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise InitWeightsError(
                        f"--init-weights {path!r}: {name!r} has shape {tuple(tensor.shape)}, "
                        f"{module.config.name} needs {tuple(target.shape)}"
                    )
                loaded[local] = tensor
    except (SafetensorError, OSError) as e:
        raise InitWeightsError(f"--init-weights {path!r} is not a readable safetensors file: {e}") from None
    with torch.no_grad():
        for local, tensor in loaded.items():
            wanted[local].copy_(tensor)
    return len(loaded)


def save_full_weights(model: StageModule, path: str) -> None:
    """Write a whole model (`build_full_model`) in the layout `load_stage_weights` reads."""
    if not (model.spec.is_first and model.spec.is_last):
        raise InitWeightsError("save_full_weights takes the whole model (build_full_model), not one stage")
    save_file({name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}, path)
