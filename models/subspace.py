"""Subspace compression at stage boundaries (issue #27): only K coefficients per token cross a
boundary, plus the token ids the next stage rebuilds the rest from.

Two kinds (`GPTConfig.subspace_kind`), both exact: the split model computes what the unsplit one
with the same option computes.

- fixed (after Pluralis' subspace networks): one seeded orthonormal basis U (d x K), a buffer on
  every stage, and a fixed seeded embedding part F(ids); the residual stream is F(ids) + U c, so a
  sender sends c = U^T (h - F(ids)). `fold_fixed_subspace` turns the model into a standard one.
- learned (after MAPL): each boundary has a trained projection P on the sending side, and a lift
  Q plus token (and position) anchors on the receiving side: h' = Q c + A[ids]. P and Q stay
  orthonormal structurally (`OrthonormalColumns`).

"fixed" is the default kind: its export loads in `transformers`. The math, where it departs from
MAPL, and what each costs in loss (benchmarks/RESULTS.md, "The convergence table in one
process"): docs/design/models.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from models.config import GPTConfig

# Seeds of the subspace parts, apart from the model's components (models/stages.py `_generator`).
_BASIS_SEED, _FIXED_EMBEDDING_SEED, _LEARNED_SEED = 7_000_001, 7_000_003, 7_100_000
_FIXED_EMBEDDING_STD = 0.02  # as the trainable embedding's initialisation


def _generator(seed: int, component: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + component)


def orthonormal_basis(d_model: int, rank: int, seed: int, component: int = _BASIS_SEED) -> torch.Tensor:
    """A (d_model, rank) float32 matrix with orthonormal columns, the same for the same arguments
    on every machine (QR of a seeded Gaussian draw, signs fixed by R's diagonal)."""
    generator = _generator(seed, component + rank)
    draw = torch.randn(d_model, rank, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(draw)
    return (q * torch.sign(torch.diagonal(r))).float()


class FixedSubspace(nn.Module):
    """The fixed basis U and the fixed embedding part F, as non-persistent buffers: derived from
    the seed on every stage, so never in a checkpoint, never averaged, never trained."""

    def __init__(self, config: GPTConfig, seed: int):
        super().__init__()
        d = config.d_model
        self.register_buffer("basis", orthonormal_basis(d, config.subspace_rank, seed), persistent=False)
        g = _generator(seed, _FIXED_EMBEDDING_SEED)
        tok = torch.randn(config.vocab_size, d, generator=g) * _FIXED_EMBEDDING_STD
        self.register_buffer("fixed_tok", tok, persistent=False)
        pos = torch.randn(config.seq_len, d, generator=g) * _FIXED_EMBEDDING_STD if config.arch == "gpt" else None
        self.register_buffer("fixed_pos", pos, persistent=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """U U^T x over the last dimension: x's component in span(U)."""
        U = self.basis.to(x.dtype)
        return (x @ U) @ U.T

    def shift(self, tokens: torch.Tensor) -> torch.Tensor:
        """F(ids): (B, T) -> (B, T, d), the fixed part of the embedding."""
        out = F.embedding(tokens, self.fixed_tok)
        if self.fixed_pos is not None:
            out = out + self.fixed_pos[: tokens.shape[1]]
        return out

    def encode(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """c = U^T (h - F(ids)): (B, T, d) -> (B, T, K)."""
        return (h - self.shift(tokens).to(h.dtype)) @ self.basis.to(h.dtype)

    def decode(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """h = F(ids) + U c: (B, T, K) -> (B, T, d)."""
        return self.shift(tokens).to(c.dtype) + c @ self.basis.to(c.dtype).T


class _ProjectOutput:
    """Forward hook: a block part's output projected onto span(U). On the attention and MLP
    modules (not their Linear layers, which LoRA replaces), so adapters stay inside the subspace."""

    def __init__(self, subspace: FixedSubspace):
        self.subspace = subspace

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.subspace.project(output)


class _EmbedInSubspace:
    """Forward hook on the embedding: F(ids) + U U^T embedding(ids)."""

    def __init__(self, subspace: FixedSubspace):
        self.subspace = subspace

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.subspace.shift(args[0]).to(output.dtype) + self.subspace.project(output)


def constrain_to_subspace(subspace: FixedSubspace, embedding: nn.Module | None, blocks: nn.ModuleList) -> None:
    """Make the embedding and every block write into span(U) (built-in blocks: `attn` and `mlp`)."""
    if embedding is not None:
        embedding.register_forward_hook(_EmbedInSubspace(subspace))
    for block in blocks:
        block.attn.register_forward_hook(_ProjectOutput(subspace))
        block.mlp.register_forward_hook(_ProjectOutput(subspace))


class OrthonormalColumns(nn.Module):
    """Parametrization: the weight is the Q factor (signs fixed by R's diagonal) of the stored
    matrix, so its columns are orthonormal whatever the optimizer does to the stored one (a QR
    retraction built into the forward). torch's `orthogonal` is not used: its Householder map
    keeps ±1 flags on the diagonal that AdamW's weight decay truncates to 0, and with
    trivialization it completes its base from the unseeded global generator (stages and replicas
    would disagree)."""

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        q, r = torch.linalg.qr(stored.float())  # float32 whatever the model's dtype (no bf16 QR)
        return (q * torch.sign(torch.diagonal(r)).unsqueeze(0)).to(stored.dtype)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


def _orthonormal_linear(config: GPTConfig, seed: int, boundary: int) -> nn.Linear:
    """A bias-free (K -> d) Linear whose (d, K) weight keeps orthonormal columns, drawn from the
    boundary's seed (so a sender's projection and its receiver's lift start equal)."""
    layer = nn.Linear(config.subspace_rank, config.d_model, bias=False)
    with torch.no_grad():
        layer.weight.copy_(
            orthonormal_basis(config.d_model, config.subspace_rank, seed, _LEARNED_SEED + 1_000 * boundary)
        )
    parametrize.register_parametrization(layer, "weight", OrthonormalColumns())
    return layer


class LearnedDown(nn.Module):
    """The sender's side of a learned boundary: c = P^T h, (B, T, d) -> (B, T, K)."""

    def __init__(self, config: GPTConfig, seed: int, boundary: int):
        super().__init__()
        self.proj = _orthonormal_linear(config, seed, boundary)

    @property
    def matrix(self) -> torch.Tensor:
        """P, (d, K), orthonormal columns."""
        return self.proj.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.proj.weight.to(h.dtype)


class LearnedUp(nn.Module):
    """The receiver's side: h' = Q c + A[ids] (+ A_pos[t] for "gpt"), (B, T, K) -> (B, T, d)."""

    def __init__(self, config: GPTConfig, seed: int, boundary: int):
        super().__init__()
        self.lift = _orthonormal_linear(config, seed, boundary)
        self.anchors = nn.Embedding(config.vocab_size, config.d_model)
        nn.init.zeros_(self.anchors.weight)
        self.pos_anchors = nn.Embedding(config.seq_len, config.d_model) if config.arch == "gpt" else None
        if self.pos_anchors is not None:
            nn.init.zeros_(self.pos_anchors.weight)

    @property
    def matrix(self) -> torch.Tensor:
        """Q, (d, K), orthonormal columns."""
        return self.lift.weight

    def forward(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = self.lift(c) + self.anchors(tokens).to(c.dtype)
        if self.pos_anchors is not None:
            h = h + self.pos_anchors.weight[: tokens.shape[1]].to(c.dtype)
        return h


_PROJECTED = ("attn.proj", "mlp.down")  # the block outputs the fixed kind constrains


@torch.no_grad()
def fold_fixed_subspace(config: GPTConfig, state_dict: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Plain weights of a fixed-subspace model: the state dict (of the whole model or of a stage,
    built-in names, adapters merged) a model with `subspace_rank=0` computes the same function
    with. U U^T is folded into every attention and MLP output projection (weight and bias), F into
    the token (and position) embedding. `seed` is the model's seed (U and F derive from it)."""
    if not config.subspace_rank or config.subspace_kind != "fixed":
        raise ValueError("fold_fixed_subspace folds a fixed-subspace model (subspace_kind 'fixed', rank > 0)")
    subspace = FixedSubspace(config, seed)
    projector = subspace.basis.double() @ subspace.basis.double().T  # (d, d)
    folded = {}
    for name, tensor in state_dict.items():
        out = tensor
        if any(name.endswith(f"{part}.weight") for part in _PROJECTED):
            out = (projector @ tensor.double()).to(tensor.dtype)  # rows = output features
        elif any(name.endswith(f"{part}.bias") for part in _PROJECTED):
            out = (projector @ tensor.double()).to(tensor.dtype)
        elif name.endswith("embedding.tok.weight"):
            out = (tensor.double() @ projector + subspace.fixed_tok.double()).to(tensor.dtype)
        elif name.endswith("embedding.pos.weight"):
            out = (tensor.double() @ projector + subspace.fixed_pos.double()).to(tensor.dtype)
        folded[name] = out
    return folded
