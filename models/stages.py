"""Splitting a GPT into pipeline stages.

Stage 0 owns the token embedding, the last stage owns the final norm, the head and the loss; the
blocks are split into contiguous ranges, described by their block boundaries
`(0, b_1, ..., n_layers)`: stage i holds blocks `b_i .. b_{i+1}-1`. The default is the equal split
(`split_layers`); a balanced split chosen from a profile (`models.balanced_split`) is passed as
explicit boundaries. Every component is initialised from its own seeded generator, so a stage
built alone holds exactly the weights the same slice of the whole model would hold, whatever the
split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from models import llama
from models.config import GPTConfig
from models.gpt import Block, Embedding, LMHead, init_weights_, language_model_loss
from models.interface import build_part, load_model_parts


class StageSplitError(ValueError):
    """Raised for a stage index or a number of stages that the model cannot be split into."""


@dataclass(frozen=True)
class StageSpec:
    """What one stage of an N-stage split holds."""

    index: int
    num_stages: int
    first_layer: int  # inclusive
    last_layer: int  # exclusive

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer)


def split_layers(n_layers: int, num_stages: int) -> list[StageSpec]:
    """Equal contiguous split of `n_layers` blocks over `num_stages` stages (earlier stages take
    the remainder). Every stage gets at least one block."""
    if num_stages < 1:
        raise StageSplitError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > n_layers:
        raise StageSplitError(f"cannot split {n_layers} layers into {num_stages} stages (at most {n_layers})")
    base, extra = divmod(n_layers, num_stages)
    specs, start = [], 0
    for index in range(num_stages):
        size = base + (1 if index < extra else 0)
        specs.append(StageSpec(index=index, num_stages=num_stages, first_layer=start, last_layer=start + size))
        start += size
    return specs


def equal_boundaries(n_layers: int, num_stages: int) -> tuple[int, ...]:
    """The block boundaries of the equal split `split_layers(n_layers, num_stages)`."""
    specs = split_layers(n_layers, num_stages)
    return (0, *(spec.last_layer for spec in specs))


def split_from_boundaries(n_layers: int, boundaries: Sequence[int]) -> list[StageSpec]:
    """Stages from explicit block boundaries `(0, b_1, ..., n_layers)`: stage i holds blocks
    b_i .. b_{i+1}-1. Every stage gets at least one block."""
    bounds = tuple(boundaries)
    if len(bounds) < 2:
        raise StageSplitError(f"split boundaries need at least two entries (0 and {n_layers}), got {list(bounds)}")
    if bounds[0] != 0 or bounds[-1] != n_layers:
        raise StageSplitError(f"split boundaries must start at 0 and end at n_layers={n_layers}, got {list(bounds)}")
    if any(b >= a for b, a in zip(bounds, bounds[1:])):
        raise StageSplitError(
            f"split boundaries must strictly increase (every stage holds at least one block), got {list(bounds)}"
        )
    num_stages = len(bounds) - 1
    return [
        StageSpec(index=i, num_stages=num_stages, first_layer=bounds[i], last_layer=bounds[i + 1])
        for i in range(num_stages)
    ]


def stage_spec(config: GPTConfig, stage: int, num_stages: int, boundaries: Sequence[int] | None = None) -> StageSpec:
    """The spec of one stage: of the equal split, or of the split `boundaries` describe (which must
    then describe `num_stages` stages)."""
    if boundaries is None:
        specs = split_layers(config.n_layers, num_stages)
    else:
        specs = split_from_boundaries(config.n_layers, boundaries)
        if len(specs) != num_stages:
            raise StageSplitError(f"split boundaries {list(boundaries)} describe {len(specs)} stages, not {num_stages}")
    if not 0 <= stage < num_stages:
        raise StageSplitError(
            f"stage {stage} is out of range: the model is split into {num_stages} stages (0..{num_stages - 1})"
        )
    return specs[stage]


def _generator(seed: int, component: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + component)


_EMBEDDING, _HEAD = 0, 1  # component ids; block i is component 2 + i

# The building blocks of each built-in architecture: (embedding, block, head), the interface
# models/interface.py documents; arch "user" takes them from the user's function instead.
_COMPONENTS: dict[str, tuple[type[nn.Module], type[nn.Module], type[nn.Module]]] = {
    "gpt": (Embedding, Block, LMHead),
    "llama": (llama.TokenEmbedding, llama.LlamaBlock, llama.LlamaHead),
}


class StageModule(nn.Module):
    """One stage. Inputs: token ids (B, T) int64 on stage 0, hidden states (B, T, C) elsewhere.
    Output: hidden states (B, T, C), or on the last stage the mean loss given `targets` (B, T)."""

    def __init__(self, config: GPTConfig, spec: StageSpec, seed: int = 0):
        super().__init__()
        self.config, self.spec = config, spec
        if config.arch == "user":
            self._build_user_parts(config, spec, seed)
            return
        embedding_cls, block_cls, head_cls = _COMPONENTS[config.arch]
        self.embedding = embedding_cls(config) if spec.is_first else None
        if self.embedding is not None:
            init_weights_(self.embedding, _generator(seed, _EMBEDDING), config.n_layers)
        self.blocks = nn.ModuleList()
        for layer in spec.layers:
            block = block_cls(config)
            init_weights_(block, _generator(seed, 2 + layer), config.n_layers)
            self.blocks.append(block)
        self.head = head_cls(config) if spec.is_last else None
        if self.head is not None:
            init_weights_(self.head, _generator(seed, _HEAD), config.n_layers)

    def _build_user_parts(self, config: GPTConfig, spec: StageSpec, seed: int) -> None:
        """The parts of a user architecture (models/interface.py), each under its own seeded state."""
        parts = load_model_parts(config.user_model)
        self.embedding = build_part(parts.embedding, seed, _EMBEDDING) if spec.is_first else None
        self.blocks = nn.ModuleList(
            build_part(lambda layer=layer: parts.block(layer), seed, 2 + layer) for layer in spec.layers
        )
        self.head = build_part(parts.head, seed, _HEAD) if spec.is_last else None

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embedding(inputs) if self.embedding is not None else inputs  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        if targets is None:
            raise ValueError("the last stage needs targets to compute the loss")
        return language_model_loss(self.head(x), targets)  # scalar

    # What the stage expects to receive, checked by the peer before any compute.
    def expected_input(self, batch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        T = self.config.seq_len
        if self.spec.is_first:
            return (batch_size, T), torch.int64
        return (batch_size, T, self.config.d_model), torch.float32


def build_block(config: GPTConfig, layer: int = 0) -> nn.Module:
    """Block `layer` of the model as its class makes it, without the seeded initialisation a stage
    gives it (under `torch.device("meta")`, a block of shapes alone: what a count needs)."""
    if config.arch == "user":
        return load_model_parts(config.user_model).block(layer)
    return _COMPONENTS[config.arch][1](config)


def build_stage(
    config: GPTConfig, stage: int, num_stages: int, seed: int = 0, boundaries: Sequence[int] | None = None
) -> StageModule:
    """One stage of the equal split, or of the split given by `boundaries`."""
    return StageModule(config, stage_spec(config, stage, num_stages, boundaries), seed)


def build_full_model(config: GPTConfig, seed: int = 0) -> StageModule:
    """The whole model as a single stage: the reference the pipeline is tested against."""
    return build_stage(config, 0, 1, seed)
