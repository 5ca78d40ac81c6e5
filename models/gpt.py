"""The GPT building blocks. Models never know how they are split; see `models.stages`.

They compute what transformers' `GPT2LMHeadModel` computes for the same weights: pre-norm blocks,
LayerNorm with `config.norm_eps`, attention scaled by 1/sqrt(head_dim), the GELU `config.activation`
names, an `lm_head` without bias (models/hf_format.py maps the names and Conv1D layouts).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.hidden_size)
        self.down = nn.Linear(config.hidden_size, config.d_model)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token + learned position embeddings: (B, T) int64 -> (B, T, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        positions = torch.arange(T, device=tokens.device)  # (T,)
        return self.tok(tokens) + self.pos(positions)  # (B, T, C)


class LMHead(nn.Module):
    """Final norm and projection to the vocabulary: (B, T, C) -> (B, T, V) logits. The projection
    has no bias, as GPT-2's `lm_head`; it is not tied to the embedding (they sit on different
    stages)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln_f(x))


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights_(module: nn.Module, generator: torch.Generator, n_layers: int) -> None:
    """GPT-2 style initialisation from an explicit generator, so that any split of the model
    gets bit-identical weights to the whole model built with the same seed."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() == 1:  # LayerNorm weight
            nn.init.ones_(p)
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            with torch.no_grad():  # = randn(shape, generator) * std, bit for bit, without a temporary
                p.normal_(0.0, 1.0, generator=generator).mul_(std)
