"""LoRA adapters on a stage's blocks (`--trainable lora:R`), through the `peft` library.

Every `nn.Linear` inside the stage's blocks gets a rank-R adapter: y = W x + b + scale * B (A x),
with A (R, in) drawn from a seeded generator (per block, so that replicas of a stage start alike and
a stage built alone equals the slice of the whole model), B (out, R) zero (so the adapted model
starts equal to the base), and scale = lora_alpha / R = 1 (lora_alpha = R). The base weights (the
blocks', the embedding's and the head's) are frozen: only the adapters are optimized, averaged
between replicas (they are the parameters that require a gradient) and checkpointed
(`trainable_state_dict`); the base weights always come from the seed, `--init-weights` or the
model folder.

peft renames the wrapped layer's tensors (`attn.qkv.weight` -> `attn.qkv.base_layer.weight`) and
adds `attn.qkv.lora_A.default.weight` / `lora_B`; `base_name` maps the first back, `merge_adapters`
and `adapters_only` give the two forms an export writes. `peft` is an optional dependency
(`pip install -e .[lora]`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.config import GPTConfig
from models.interface import build_part
from models.stages import build_block

ADAPTER = "default"  # peft's adapter name
_LORA_COMPONENT_OFFSET = 10_000_000  # seeds of the adapters apart from the parts' own


class LoraUnavailableError(RuntimeError):
    """`--trainable lora:R` without the peft library installed."""


def _peft():
    try:
        import peft
    except ImportError:
        raise LoraUnavailableError(
            "--trainable lora:R needs the peft library: pip install 'swarm[lora]' (or pip install peft)"
        ) from None
    return peft


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """`blocks.0.attn.qkv.base_layer.weight` -> `blocks.0.attn.qkv.weight` (other names unchanged)."""
    return name.replace(".base_layer.", ".")


def adapter_parameters_per_block(config: GPTConfig, rank: int) -> int:
    """What `add_adapters` adds to one block: rank x (in + out) for each of its nn.Linear layers,
    counted on block 0 built on the meta device (no memory, no peft; every built-in block is
    alike, and a user architecture's block 0 stands for all, as in its parameter counts)."""
    try:
        with torch.device("meta"):
            block = build_block(config, 0)
    except Exception:  # noqa: BLE001  a user block that needs real values to be made: made for real, once
        block = build_block(config, 0)
    return sum(rank * (m.in_features + m.out_features) for m in block.modules() if isinstance(m, nn.Linear))


def add_adapters(stage: nn.Module, rank: int, *, seed: int = 0, first_layer: int = 0) -> int:
    """Wrap every nn.Linear of `stage.blocks` with a rank-`rank` LoRA adapter and freeze everything
    else. Block i of the stage (global index first_layer + i) draws its A matrices from its own
    seeded generator. Returns the number of trainable (adapter) parameters."""
    peft = _peft()
    for p in stage.parameters():
        p.requires_grad_(False)
    for offset, block in enumerate(stage.blocks):
        targets = [name for name, m in block.named_modules() if isinstance(m, nn.Linear)]
        if not targets:
            continue
        config = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=targets)
        component = _LORA_COMPONENT_OFFSET + first_layer + offset

        def inject(block=block, config=config) -> nn.Module:
            return peft.inject_adapter_in_model(config, block, adapter_name=ADAPTER)

        build_part(inject, seed, component)
    for name, p in stage.named_parameters():
        p.requires_grad_(is_adapter(name))
    return sum(p.numel() for p in stage.parameters() if p.requires_grad)


def trainable_state_dict(stage: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint and a state transfer hold: with adapters only the adapters, else everything."""
    state = stage.state_dict()
    if any(is_adapter(name) for name in state):
        return {name: t for name, t in state.items() if is_adapter(name)}
    return state


def adapter_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} from a state dict holding lora_A / lora_B tensors."""
    pairs = {}
    for name, a in state.items():
        if f".lora_A.{ADAPTER}." in name:
            layer = name.split(f".lora_A.{ADAPTER}.")[0]
            pairs[f"{layer}.weight"] = (a, state[f"{layer}.lora_B.{ADAPTER}.weight"])
    return pairs


def merge_adapters(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """Base weights plus adapters: W + scale * B @ A for every adapted layer, the rest unchanged.
    `base` in base names (`blocks.0.attn.qkv.weight`), `adapters` as `adapters_only` gives them."""
    merged = {name: t.clone() for name, t in base.items()}
    for name, (a, b) in adapter_pairs(adapters).items():
        if name not in merged:
            raise KeyError(f"adapter for {name!r}, which the base weights do not hold")
        merged[name] = merged[name] + scale * (b.to(merged[name].dtype) @ a.to(merged[name].dtype))
    return merged


def adapters_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a stage's state dict (what `--adapters-only` writes)."""
    return {name: t for name, t in state.items() if is_adapter(name)}


def base_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base tensors of an adapted stage's state dict, under their original names."""
    return {base_name(name): t for name, t in state.items() if not is_adapter(name)}
