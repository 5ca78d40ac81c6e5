"""Token shards on disk and the `meta.json` that describes them.

A prepared folder holds `train-00000.bin`, ... and `val-00000.bin`, ... (raw little-endian token
ids, `dtype` from meta), `tokenizer.json`, and `meta.json`, written last and atomically: a folder
without it is an interrupted or foreign one. The trainer reads the shards window by window (windows.py), so
its memory does not grow with the corpus.
"""

from __future__ import annotations

import json
import os

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm.data.errors import DataError

FORMAT = "swarm-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 24  # 16M tokens: 32 MiB of uint16 per shard


class ShardInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(min_length=1, max_length=64, pattern=r"^[a-z]+-\d{5}\.bin$")
    tokens: int = Field(ge=0)


class SplitInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(ge=0)
    documents: int = Field(ge=0)
    shards: list[ShardInfo] = Field(default_factory=list)


class InputInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    bytes: int = Field(ge=0)
    sha256: str = Field(min_length=64, max_length=64)


class DataMeta(BaseModel):
    """What `meta.json` says: enough to read the shards and to tell whether a re-run can reuse them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str
    version: int
    vocab_size: int = Field(ge=1)
    dtype: str = Field(pattern=r"^uint(8|16|32)$")
    tokenizer: str  # bytes, bpe:VOCAB, or the tokenizer file it was given
    eos_id: int | None = None  # the token after each document (None: documents are joined as they are)
    documents: int = Field(ge=0)
    text_bytes: int = Field(ge=0)
    bad_lines: int = Field(ge=0, default=0)
    val_fraction: float = Field(ge=0.0, lt=1.0)
    text_field: str
    splits: dict[str, SplitInfo]
    inputs: list[InputInfo]
    recipe: str  # hash of everything the tokens depend on: inputs, tokenizer, split, text field


class ShardWriter:
    """Appends token ids to `<split>-NNNNN.bin` files of at most `shard_tokens` tokens each."""

    def __init__(self, folder: str, split: str, dtype: np.dtype, shard_tokens: int = DEFAULT_SHARD_TOKENS):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.shards: list[ShardInfo] = []
        self.documents = 0
        self._file = None
        self._in_shard = 0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards) + self._in_shard

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:
            raise DataError(f"token id {int(ids.max())} does not fit {self.dtype.name}")
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None:
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._file, self._name, self._in_shard = open(os.path.join(self.folder, name), "wb"), name, 0
            take = min(ids.size, self.shard_tokens - self._in_shard)
            self._file.write(ids[:take].astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            self._in_shard += take
            ids = ids[take:]
            if self._in_shard == self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards.append(ShardInfo(file=self._name, tokens=self._in_shard))
            self._file, self._in_shard = None, 0

    def close(self) -> SplitInfo:
        self._finish_shard()
        return SplitInfo(tokens=self.tokens, documents=self.documents, shards=self.shards)


def write_meta(folder: str, meta: DataMeta) -> None:
    """Atomically: a reader sees the whole meta.json or none."""
    path = os.path.join(folder, META_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(meta.model_dump(mode="json"), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(folder: str) -> DataMeta:
    """The meta of a prepared folder; DataError for a missing, interrupted, older or foreign one."""
    if not os.path.isdir(folder):
        raise DataError(f"data folder {folder!r} does not exist; create it with: swarm data prepare INPUT... --out DIR")
    path = os.path.join(folder, META_FILE)
    if not os.path.isfile(path):
        raise DataError(
            f"data folder {folder!r} has no {META_FILE}: not a prepared dataset, or its prepare was interrupted; "
            f"run swarm data prepare again"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path!r} cannot be read: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DataError(
            f"{path!r} is not a swarm dataset (format {raw.get('format') if isinstance(raw, dict) else None!r})"
        )
    if raw.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path!r} is format version {raw.get('version')!r}, this swarm reads version {FORMAT_VERSION}; "
            f"prepare the data again with this version"
        )
    try:
        meta = DataMeta.model_validate(raw)
    except ValidationError as e:
        raise DataError(f"{path!r} is malformed: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None
    for split, info in meta.splits.items():
        for shard in info.shards:
            shard_path = os.path.join(folder, shard.file)
            expected = shard.tokens * np.dtype(meta.dtype).itemsize
            if not os.path.isfile(shard_path) or os.path.getsize(shard_path) != expected:
                raise DataError(f"shard {shard_path!r} is missing or not {expected} bytes; prepare the data again")
    return meta
