"""Splitting a GPT into pipeline stages.

Stage 0 owns the token embedding, the last stage owns the final norm, the head and the loss; the
blocks are split into contiguous ranges, described by their block boundaries
`(0, b_1, ..., n_layers)`: stage i holds blocks `b_i .. b_{i+1}-1`. The default is the equal split
(`split_layers`); a balanced split chosen from a profile (`models.balanced_split`) is passed as
explicit boundaries. Every component is initialised from its own seeded generator, so a stage
built alone holds exactly the weights the same slice of the whole model would hold, whatever the
split.

With subspace compression on (`GPTConfig.subspace_rank` K > 0, models/subspace.py) a boundary
carries K coefficients per token, and every stage after the first also takes the microbatch's
token ids (`tokens`) to rebuild the residual stream from them.
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
from models.subspace import FixedSubspace, LearnedDown, LearnedUp, constrain_to_subspace


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


def boundary_width(config: GPTConfig) -> int:
    """Values per token that cross a stage boundary: K with subspace compression, else d_model."""
    return config.subspace_rank or config.d_model


class StageModule(nn.Module):
    """One stage. Inputs: token ids (B, T) int64 on stage 0, hidden states (B, T, C) elsewhere.
    Output: hidden states (B, T, C), or on the last stage the mean loss given `targets` (B, T).

    With subspace compression on, the hidden states that enter and leave are the K coefficients
    (B, T, K) instead, and a stage after the first needs the token ids `tokens` (B, T) too.
    `cuts`: block boundaries inside this stage where a learned subspace puts its bottleneck (the
    whole model built for a split, `build_full_model(..., boundaries)`); empty for a split's stage.
    """

    def __init__(self, config: GPTConfig, spec: StageSpec, seed: int = 0, cuts: Sequence[int] = ()):
        super().__init__()
        self.config, self.spec = config, spec
        self._cuts = tuple(cuts)
        self.subspace = self.boundary_down = self.boundary_up = None
        if any(not spec.first_layer < cut < spec.last_layer for cut in self._cuts):
            raise StageSplitError(
                f"cuts {list(cuts)} must lie strictly inside blocks {spec.first_layer}..{spec.last_layer}"
            )
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
        self._add_subspace(seed)

    def _add_subspace(self, seed: int) -> None:
        """The fixed basis (every stage) or the learned boundary modules, keyed by the block
        boundary they sit at: a sender's `boundary_down[b]`, a receiver's `boundary_up[b]`."""
        config, spec = self.config, self.spec
        if not config.subspace_rank:
            return
        if config.subspace_kind == "fixed":
            self.subspace = FixedSubspace(config, seed)
            constrain_to_subspace(self.subspace, self.embedding, self.blocks)
            return
        senders = [*self._cuts, *([] if spec.is_last else [spec.last_layer])]
        receivers = [*([] if spec.is_first else [spec.first_layer]), *self._cuts]
        self.boundary_down = nn.ModuleDict({str(b): LearnedDown(config, seed, b) for b in senders})
        self.boundary_up = nn.ModuleDict({str(b): LearnedUp(config, seed, b) for b in receivers})

    def _build_user_parts(self, config: GPTConfig, spec: StageSpec, seed: int) -> None:
        """The parts of a user architecture (models/interface.py), each under its own seeded state."""
        parts = load_model_parts(config.user_model)
        self.embedding = build_part(parts.embedding, seed, _EMBEDDING) if spec.is_first else None
        self.blocks = nn.ModuleList(
            build_part(lambda layer=layer: parts.block(layer), seed, 2 + layer) for layer in spec.layers
        )
        self.head = build_part(parts.head, seed, _HEAD) if spec.is_last else None

    @property
    def needs_tokens(self) -> bool:
        """Whether `forward` needs the microbatch's token ids beside its inputs."""
        return bool(self.config.subspace_rank) and not self.spec.is_first

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        x, tokens = self._through_blocks(inputs, tokens)
        if self.head is None:
            return self._send(x, tokens)
        if targets is None:
            raise ValueError("the last stage needs targets to compute the loss")
        return language_model_loss(self.head(x), targets)  # scalar

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of a whole model (one stage holding everything) for token ids (B, T):
        what generation samples from."""
        if not (self.spec.is_first and self.head is not None):
            raise ValueError("logits() needs the whole model: the embedding and the head on one stage")
        x, _ = self._through_blocks(tokens, None)
        return self.head(x)

    def _through_blocks(
        self, inputs: torch.Tensor, tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream after this stage's blocks (B, T, C), and the token ids it went with."""
        if self.spec.is_first:
            tokens = inputs
        elif self.needs_tokens and tokens is None:
            raise ValueError(
                f"stage {self.spec.index} of a subspace-compressed model needs the microbatch's token ids (tokens=)"
            )
        x = self._receive(inputs, tokens)  # (B, T, C)
        for offset, block in enumerate(self.blocks):
            layer = self.spec.first_layer + offset
            if layer in self._cuts:  # a learned boundary inside the whole model
                x = self.boundary_up[str(layer)](self.boundary_down[str(layer)](x), tokens)
            x = block(x)
        return x, tokens

    def _receive(self, inputs: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """The residual stream entering the first block: (B, T, C)."""
        if self.embedding is not None:
            return self.embedding(inputs)
        if self.subspace is not None:
            return self.subspace.decode(inputs, tokens)
        if self.boundary_up is not None:
            return self.boundary_up[str(self.spec.first_layer)](inputs, tokens)
        return inputs

    def _send(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What crosses the boundary after this stage: (B, T, C), or (B, T, K) compressed."""
        if self.subspace is not None:
            return self.subspace.encode(x, tokens)
        if self.boundary_down is not None:
            return self.boundary_down[str(self.spec.last_layer)](x)
        return x

    # What the stage expects to receive, checked by the peer before any compute.
    def expected_input(self, batch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        T = self.config.seq_len
        if self.spec.is_first:
            return (batch_size, T), torch.int64
        return (batch_size, T, boundary_width(self.config)), torch.float32


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


def build_full_model(config: GPTConfig, seed: int = 0, boundaries: Sequence[int] | None = None) -> StageModule:
    """The whole model as a single stage: the reference the pipeline is tested against. A learned
    subspace puts a bottleneck at each stage boundary, so it needs the split's `boundaries`
    (0, b_1, ..., n_layers) to be the same function as that split; other models ignore them."""
    spec = stage_spec(config, 0, 1)
    cuts: tuple[int, ...] = ()
    if config.subspace_rank and config.subspace_kind == "learned":
        if boundaries is None:
            raise StageSplitError(
                "a learned-subspace model has a bottleneck at each stage boundary: pass the split's boundaries"
            )
        cuts = tuple(
            split_from_boundaries(config.n_layers, boundaries)[i].first_layer for i in range(1, len(boundaries) - 1)
        )
    elif boundaries is not None:
        split_from_boundaries(config.n_layers, boundaries)  # checked all the same
    return StageModule(config, spec, seed, cuts)
