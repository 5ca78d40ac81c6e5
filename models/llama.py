"""LLaMA-style building blocks: RMSNorm, rotary position embeddings, SwiGLU, no biases.

Same interfaces as models/gpt.py (a block maps (B, T, C) -> (B, T, C); the embedding maps token
ids to (B, T, C); the head maps (B, T, C) to logits), so `models.stages` splits either kind.
Parameter names follow gpt.py where the roles match (`attn.qkv`, `attn.proj`, `mlp.up`,
`mlp.down`), so `init_weights_` scales the residual projections the same way.

They compute what transformers' `LlamaForCausalLM` computes for the same weights (multi-head or
grouped-query attention, no rope scaling): RMSNorm with `config.norm_eps` in float32, rotary embeddings in the
rotate_half convention with base `config.rope_base`, attention scaled by 1/sqrt(head_dim).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import GPTConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary_tables(head_dim: int, seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim // 2), in float32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hs/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + hs/2]) of features of x (B, nh, T, hs) by their position's
    angle: the "rotate_half" convention of transformers' Llama (first half, second half of the
    head), not interleaved pairs."""
    T, half = x.shape[2], x.shape[-1] // 2
    x32 = x.float()
    first, second = x32[..., :half], x32[..., half:]  # (B, nh, T, hs/2) each
    c, s = cos[:T], sin[:T]  # (T, hs/2)
    rotated = torch.cat((first * c - second * s, second * c + first * s), dim=-1)  # (B, nh, T, hs)
    return rotated.to(x.dtype)


class RotaryAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        kv_width = config.kv_heads * config.head_dim
        self.widths = (config.d_model, kv_width, kv_width)  # rows of q, k and v in the fused projection
        self.qkv = nn.Linear(config.d_model, sum(self.widths), bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.seq_len, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)  # derived, so never in a checkpoint
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = self.head_dim
        q, k, v = self.qkv(x).split(self.widths, dim=2)  # (B, T, C), 2 x (B, T, nkv * hs)
        q = q.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.kv_heads, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.kv_heads, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        if self.kv_heads != self.n_heads:  # grouped-query: query head j uses key/value head j // group
            group = self.n_heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.hidden_size, bias=False)
        self.up = nn.Linear(config.d_model, config.hidden_size, bias=False)
        self.down = nn.Linear(config.hidden_size, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, C)


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(rmsnorm(x)), then x + swiglu(rmsnorm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm_1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = RotaryAttention(config)
        self.norm_2 = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class TokenEmbedding(nn.Module):
    """Token embeddings only (positions enter through the rotary attention): (B, T) -> (B, T, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)  # (B, T, C)


class LlamaHead(nn.Module):
    """Final RMSNorm and projection to the vocabulary: (B, T, C) -> (B, T, V) logits."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))
