"""Splitting a GPT into pipeline stages.

Stage 0 owns the token embedding, the last stage owns the final norm, the head and the loss; the
blocks are split into contiguous ranges. The split is a pure function of (n_layers, num_stages)
and every component is initialised from its own seeded generator, so a stage built alone holds
exactly the weights the same slice of the whole model would hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from models.config import GPTConfig
from models.gpt import Block, Embedding, LMHead, init_weights_, language_model_loss


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


def stage_spec(config: GPTConfig, stage: int, num_stages: int) -> StageSpec:
    specs = split_layers(config.n_layers, num_stages)
    if not 0 <= stage < num_stages:
        raise StageSplitError(f"stage {stage} is out of range: the model is split into {num_stages} stages (0..{num_stages - 1})")
    return specs[stage]


def _generator(seed: int, component: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + component)


_EMBEDDING, _HEAD = 0, 1  # component ids; block i is component 2 + i


class StageModule(nn.Module):
    """One stage. Inputs: token ids (B, T) int64 on stage 0, hidden states (B, T, C) elsewhere.
    Output: hidden states (B, T, C), or on the last stage the mean loss given `targets` (B, T)."""

    def __init__(self, config: GPTConfig, spec: StageSpec, seed: int = 0):
        super().__init__()
        self.config, self.spec = config, spec
        self.embedding = Embedding(config) if spec.is_first else None
        if self.embedding is not None:
            init_weights_(self.embedding, _generator(seed, _EMBEDDING), config.n_layers)
        self.blocks = nn.ModuleList()
        for layer in spec.layers:
            block = Block(config)
            init_weights_(block, _generator(seed, 2 + layer), config.n_layers)
            self.blocks.append(block)
        self.head = LMHead(config) if spec.is_last else None
        if self.head is not None:
            init_weights_(self.head, _generator(seed, _HEAD), config.n_layers)

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


def build_stage(config: GPTConfig, stage: int, num_stages: int, seed: int = 0) -> StageModule:
    return StageModule(config, stage_spec(config, stage, num_stages), seed)


def build_full_model(config: GPTConfig, seed: int = 0) -> StageModule:
    """The whole model as a single stage: the reference the pipeline is tested against."""
    return build_stage(config, 0, 1, seed)
