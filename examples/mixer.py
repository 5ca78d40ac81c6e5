"""An architecture of one's own for `--model examples.mixer:mixer` (models/interface.py): byte
tokens, a learned causal token-mixing matrix and a channel MLP per block, a linear read-out.

    swarm demo --model examples.mixer:mixer --tokenizer bytes --peers 2 --steps 5 --batch-size 8

Every peer and the trainer must run this same file (its hash is part of the model's fingerprint).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.interface import ModelParts

VOCAB, SEQ, WIDTH, BLOCKS = 256, 64, 128, 4


class Embedding(nn.Module):
    """Token and position embeddings: (B, T) int64 -> (B, T, C)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))


class MixerBlock(nn.Module):
    """(B, T, C) -> (B, T, C): x + causal_mix(norm(x)), then x + mlp(norm(x)). The mixing matrix is
    lower-triangular, so no position sees a later one."""

    def __init__(self):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.mix = nn.Parameter(torch.randn(SEQ, SEQ) / SEQ)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        x = x + torch.tril(self.mix[:T, :T]) @ self.norm_1(x)
        return x + self.mlp(self.norm_2(x))


class Head(nn.Module):
    """(B, T, C) -> (B, T, VOCAB) logits; the last stage adds the loss."""

    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def mixer() -> ModelParts:
    return ModelParts(
        vocab_size=VOCAB,
        seq_len=SEQ,
        d_model=WIDTH,
        n_layers=BLOCKS,
        embedding=Embedding,
        block=lambda index: MixerBlock(),
        head=Head,
    )
