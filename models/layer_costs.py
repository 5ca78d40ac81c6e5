"""A model as an ordered graph of layers with measured costs: the record `swarm profile` writes.

The graph is the chain the pipeline runs: the embedding, blocks 0..n-1, then the head with the
loss; each layer feeds the next. Each layer carries its forward and backward seconds for one
microbatch of `batch_size` samples, its parameter, gradient and optimizer-state bytes, and the
bytes of the activation it hands on (its output; the gradient that comes back is the same size).
Splitting works on this data, not on code: `split_costs` turns it into what
`models.balanced_split` needs, and the planner reads the transfer sizes from it. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from models.balanced_split import SplitCosts
from process.atomic_files import write_atomically

__all__ = ["ProfileError", "LayerKind", "LayerCost", "ModelProfile", "split_costs"]

PROFILE_FORMAT = 1


class ProfileError(ValueError):
    """A profile file that cannot be read or does not describe a model; the message says why."""


class LayerKind(str, Enum):
    EMBEDDING = "embedding"  # token + position embeddings: first stage only
    BLOCK = "block"  # a transformer block: any stage
    HEAD = "head"  # final norm, projection to the vocabulary and the loss: last stage only


class LayerCost(BaseModel):
    """One node of the chain, measured on one microbatch of the profile's `batch_size` samples."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    name: str = Field(min_length=1, max_length=64)  # "embedding", "block.3", "head"
    kind: LayerKind
    forward_s: float = Field(ge=0.0, allow_inf_nan=False)
    backward_s: float = Field(ge=0.0, allow_inf_nan=False)
    parameters: int = Field(ge=0)
    parameter_bytes: int = Field(ge=0)
    gradient_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0, description="optimizer state (AdamW: two moments per parameter)")
    output_bytes: int = Field(ge=0, description="activation handed to the next layer (the loss for the head)")

    @property
    def compute_s(self) -> float:
        """Forward plus backward: what one microbatch costs this layer on a peer."""
        return self.forward_s + self.backward_s

    @property
    def memory_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what holding this layer takes on a peer."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


class ModelProfile(BaseModel):
    """The measured chain of one model on one device. Written and read as JSON."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    format: int = Field(default=PROFILE_FORMAT, ge=1)
    model: str = Field(min_length=1, max_length=128)
    n_layers: int = Field(ge=1)
    d_model: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    batch_size: int = Field(ge=1, description="samples per measured microbatch")
    device: str = Field(max_length=64)
    device_name: str = Field(default="", max_length=256)
    num_threads: int = Field(ge=1)
    repeats: int = Field(ge=1, description="timed runs per layer; the median is kept")
    optimizer: str = Field(max_length=32)
    torch_version: str = Field(default="", max_length=64)
    layers: tuple[LayerCost, ...]

    @model_validator(mode="after")
    def _chain_matches_the_model(self) -> ModelProfile:
        kinds = [layer.kind for layer in self.layers]
        expected = [LayerKind.EMBEDDING, *[LayerKind.BLOCK] * self.n_layers, LayerKind.HEAD]
        if kinds != expected:
            raise ValueError(
                f"layers must be the embedding, {self.n_layers} blocks and the head, in that order; "
                f"got {[k.value for k in kinds]}"
            )
        return self

    # --- views -----------------------------------------------------------------------------------
    @property
    def embedding(self) -> LayerCost:
        return self.layers[0]

    @property
    def blocks(self) -> tuple[LayerCost, ...]:
        return self.layers[1:-1]

    @property
    def head(self) -> LayerCost:
        return self.layers[-1]

    def stage_layers(self, boundaries: Sequence[int]) -> list[list[LayerCost]]:
        """The layers each stage of a split holds (the embedding on the first, the head on the last)."""
        bounds = _check_boundaries(boundaries, self.n_layers)
        stages = [list(self.blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
        stages[0].insert(0, self.embedding)
        stages[-1].append(self.head)
        return stages

    def boundary_activation_bytes_per_sample(self, boundaries: Sequence[int]) -> tuple[float, ...]:
        """Bytes of the activation crossing each cut between stages, per sample (one way)."""
        bounds = _check_boundaries(boundaries, self.n_layers)
        return tuple(self.blocks[b - 1].output_bytes / self.batch_size for b in bounds[1:-1])

    def stage_gradient_bytes(self, boundaries: Sequence[int]) -> tuple[int, ...]:
        """Gradient bytes of each stage: what its replicas exchange when they average."""
        return tuple(sum(layer.gradient_bytes for layer in stage) for stage in self.stage_layers(boundaries))

    def stage_memory_bytes(self, boundaries: Sequence[int]) -> tuple[int, ...]:
        """Parameters + gradients + optimizer state of each stage."""
        return tuple(sum(layer.memory_bytes for layer in stage) for stage in self.stage_layers(boundaries))

    # --- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Any) -> ModelProfile:
        if not isinstance(data, dict):
            raise ProfileError(f"a profile must be a JSON object, got {type(data).__name__}")
        try:
            return cls.model_validate_json(json.dumps(data))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "profile"
            raise ProfileError(f"not a valid model profile: {where}: {first['msg']}") from None

    @classmethod
    def read(cls, path: str | Path) -> ModelProfile:
        """Read and validate a profile file; raises `ProfileError` with a one-line reason."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ProfileError(f"cannot read profile {str(path)!r}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {str(path)!r} is not valid JSON (line {e.lineno}: {e.msg})") from None
        try:
            return cls.from_dict(data)
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None

    def write(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Write atomically (a reader never sees half a file); `extra` adds top-level keys that
        readers of the profile ignore (e.g. a suggested split)."""
        write_atomically(path, json.dumps({**self.to_dict(), **(extra or {})}, indent=1) + "\n")


def _check_boundaries(boundaries: Sequence[int], n_layers: int) -> tuple[int, ...]:
    bounds = tuple(int(b) for b in boundaries)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n_layers or any(b >= a for b, a in zip(bounds, bounds[1:])):
        raise ProfileError(f"split boundaries must strictly increase from 0 to {n_layers}, got {list(bounds)}")
    return bounds


def split_costs(profile: ModelProfile, *, link_bytes_per_s: float | None = None) -> SplitCosts:
    """What `balanced_split` needs from a profile. With `link_bytes_per_s`, each cut also costs
    the time to send the activation forward and its gradient back over such a link."""
    cuts = None
    if link_bytes_per_s is not None:
        if not link_bytes_per_s > 0:
            raise ProfileError(f"link_bytes_per_s must be positive, got {link_bytes_per_s}")
        cuts = tuple(2 * block.output_bytes / link_bytes_per_s for block in profile.blocks[:-1])
    return SplitCosts(
        block_s=tuple(block.compute_s for block in profile.blocks),
        first_extra_s=profile.embedding.compute_s,
        last_extra_s=profile.head.compute_s,
        cut_s=cuts,
    )
