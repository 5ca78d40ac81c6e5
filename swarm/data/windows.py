"""Windows of tokens drawn from a prepared split's shards (read window by window: the trainer
holds only the windows it reads, whatever the corpus size), cut into the microbatches of a step.

`MicrobatchSampler` draws a step's windows at offsets from a generator seeded by (seed, step): the
batch of a step is the same on every run, so a resumed run continues from the same data position.
A window may span two shards. `validation_batches` reads windows evenly spread over the val split:
the same ones every time, so that validation losses are comparable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from swarm.data.errors import DataError
from swarm.data.shards import DataMeta


class ShardedTokens:
    """The tokens of one split, concatenated over its shards, read with positional reads (pread).

    Not memory maps: reading random windows through np.memmap grew the trainer's RSS with the
    corpus (measured: +180 MB after 6,400 windows of 129 tokens from a 200 MB shard set, as each
    page fault maps its 64 KB neighbourhood from the page cache); pread copies only the window."""

    def __init__(self, folder: str, meta: DataMeta, split: str):
        info = meta.splits.get(split)
        self.split = split
        self.dtype = np.dtype(meta.dtype).newbyteorder("<")
        shards = [s for s in (info.shards if info else []) if s.tokens]
        self.fds = [os.open(os.path.join(folder, s.file), os.O_RDONLY) for s in shards]
        self.sizes = [s.tokens for s in shards]
        self.ends = np.cumsum(self.sizes, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens start .. start+length-1 as int64, across shard edges."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window {start}..{start + length} outside 0..{len(self)}")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.ends, start, side="right"))
        done, itemsize = 0, self.dtype.itemsize
        while done < length:
            shard_start = int(self.ends[shard - 1]) if shard else 0
            offset = start + done - shard_start
            take = min(length - done, self.sizes[shard] - offset)
            raw = os.pread(self.fds[shard], take * itemsize, offset * itemsize)
            if len(raw) != take * itemsize:
                raise DataError(f"shard {shard} of the {self.split} split is shorter than meta.json says")
            out[done : done + take] = np.frombuffer(raw, dtype=self.dtype)
            done += take
            shard += 1
        return out

    def windows(self, starts, length: int) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.read(int(s), length) for s in starts]))


class TensorTokens:
    """Tokens held in memory (a tensor), with the same interface as ShardedTokens."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, starts, length: int) -> torch.Tensor:
        offsets = torch.as_tensor(starts)[:, None] + torch.arange(length)[None, :]
        return self.tokens[offsets].long()


@dataclass(frozen=True)
class Microbatch:
    step: int
    index: int  # position within the step
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64, inputs shifted by one

    @property
    def size(self) -> int:
        return self.inputs.shape[0]


def _cut(step: int, windows: torch.Tensor, microbatch_size: int) -> list[Microbatch]:
    x, y = windows[:, :-1], windows[:, 1:]
    m = microbatch_size
    return [Microbatch(step, i, x[i * m : (i + 1) * m], y[i * m : (i + 1) * m]) for i in range(len(x) // m)]


def check_enough_tokens(tokens, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 2:
        raise DataError(
            f"the {what} has {len(tokens):,} tokens, fewer than one window of {seq_len + 1} (+1); "
            f"use a larger corpus or a model with a shorter context"
        )


class MicrobatchSampler:
    """Batches drawn at random offsets from a generator seeded by (seed, step)."""

    def __init__(self, tokens, *, seq_len: int, batch_size: int, microbatch_size: int, seed: int = 0):
        self.tokens = TensorTokens(tokens) if isinstance(tokens, torch.Tensor) else tokens
        check_enough_tokens(self.tokens, seq_len, "training data")
        if batch_size % microbatch_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of microbatch_size {microbatch_size}")
        self.seq_len, self.seed = seq_len, seed
        self.batch_size, self.microbatch_size = batch_size, microbatch_size

    @property
    def microbatches_per_step(self) -> int:
        return self.batch_size // self.microbatch_size

    def batch(self, step: int) -> list[Microbatch]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g)
        return _cut(step, self.tokens.windows(starts.tolist(), self.seq_len + 1), self.microbatch_size)


def validation_batches(
    tokens, *, seq_len: int, batch_size: int, microbatch_size: int, batches: int
) -> list[list[Microbatch]]:
    """`batches` batches of windows spread evenly over the validation tokens (always the same ones)."""
    tokens = TensorTokens(tokens) if isinstance(tokens, torch.Tensor) else tokens
    check_enough_tokens(tokens, seq_len, "validation split")
    count = batches * batch_size
    last_start = len(tokens) - seq_len - 1
    starts = np.linspace(0, last_start, count).astype(np.int64) if count > 1 else np.zeros(1, dtype=np.int64)
    return [
        _cut(-1 - b, tokens.windows(starts[b * batch_size : (b + 1) * batch_size], seq_len + 1), microbatch_size)
        for b in range(batches)
    ]
