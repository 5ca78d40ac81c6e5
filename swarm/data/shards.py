"""The prepared data folder: `meta.json`, `tokenizer.json` and token shards.

    DIR/meta.json          written last, atomically: its presence means the folder is complete
    DIR/tokenizer.json     the tokenizer the shards were made with
    DIR/tokenizer_config.json  what transformers' AutoTokenizer reads beside it (class, end-of-text token)
    DIR/train-00000.bin    token ids, raw, in meta's dtype (uint8/uint16/uint32 by vocabulary size)
    DIR/val-00000.bin      the validation split: whole documents held out

A reader reads the shards window by window with pread (`open_prepared`), so a trainer's memory does not grow with the
corpus. A folder without meta.json was interrupted; one whose meta.json has another `format` or
`version` was written by something else, and is refused in one line.
"""

from __future__ import annotations

import json
import os

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from process.atomic_files import write_atomically
from swarm.data.sources import CorpusError

FORMAT = "swarm-tokens"
VERSION = 1
META = "meta.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # what transformers' AutoTokenizer reads beside tokenizer.json
SPLITS = ("train", "val")


class ShardInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    file: str = Field(pattern=r"^(train|val)-\d{5}\.bin$")
    tokens: int = Field(ge=0)


class SplitInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: int = Field(ge=0)
    documents: int = Field(ge=0)
    shards: list[ShardInfo]


class InputInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    bytes: int = Field(ge=0)
    sha256: str = Field(min_length=64, max_length=64)


class DataMeta(BaseModel):
    """meta.json: what the folder holds and what it was made from."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    format: str
    version: int
    vocab_size: int = Field(ge=1)
    dtype: str = Field(pattern=r"^uint(8|16|32)$")
    tokenizer: str  # the --tokenizer it was made with (bytes, bpe:N, file:PATH)
    val_fraction: float = Field(ge=0.0, lt=1.0)
    text_field: str
    documents: int = Field(ge=0)
    skipped_lines: dict[str, int] = Field(default_factory=dict)
    inputs: list[InputInfo]
    splits: dict[str, SplitInfo]

    def tokens(self, split: str) -> int:
        return self.splits[split].tokens if split in self.splits else 0


def is_prepared(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, META))


def read_meta(folder: str) -> DataMeta:
    """The folder's meta.json, checked; CorpusError (one line) for anything else."""
    path = os.path.join(folder, META)
    if not os.path.isdir(folder):
        raise CorpusError(f"data folder {folder!r} does not exist")
    if not os.path.isfile(path):
        raise CorpusError(
            f"data folder {folder!r} has no {META}: it is not a prepared dataset, or its preparation was "
            f"interrupted; run `swarm data prepare INPUT... --out {folder}`"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path!r} is not readable JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CorpusError(
            f"{path!r} is not a swarm dataset (format {raw.get('format') if isinstance(raw, dict) else None!r}); prepare it with `swarm data prepare`"
        )
    if raw.get("version") != VERSION:
        raise CorpusError(
            f"{path!r} is format version {raw.get('version')!r}, this swarm reads version {VERSION}: prepare the data again"
        )
    try:
        return DataMeta.model_validate(raw)
    except ValidationError as e:
        raise CorpusError(f"{path!r} is malformed: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


def write_meta(folder: str, meta: DataMeta) -> None:
    """Atomically, and last: a reader sees the whole meta.json or none."""
    write_atomically(os.path.join(folder, META), json.dumps(meta.model_dump(mode="json"), indent=2), durable=True)


class ShardWriter:
    """Appends token arrays to `<split>-NNNNN.bin` files of at most `shard_tokens` tokens."""

    def __init__(self, folder: str, split: str, dtype: np.dtype, shard_tokens: int = 1 << 27):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[ShardInfo] = []
        self.tokens = self.documents = 0
        self._file, self._in_shard = None, 0

    def _open_next(self) -> None:
        self._close_current()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(os.path.join(self.folder, name), "wb")
        self.shards.append(ShardInfo(file=name, tokens=0))
        self._in_shard = 0

    def _close_current(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards[-1] = ShardInfo(file=self.shards[-1].file, tokens=self._in_shard)
            self._file = None

    def write(self, ids: np.ndarray) -> None:
        self.documents += 1
        start = 0
        while start < len(ids):
            if self._file is None or self._in_shard >= self.shard_tokens:
                self._open_next()
            take = min(len(ids) - start, self.shard_tokens - self._in_shard)
            self._file.write(ids[start : start + take].astype(self.dtype).tobytes())
            self._in_shard += take
            self.tokens += take
            start += take

    def close(self) -> SplitInfo:
        self._close_current()
        return SplitInfo(tokens=self.tokens, documents=self.documents, shards=list(self.shards))


class TokenSplit:
    """One split's shards, read as one sequence of `len(self)` tokens, window by window with
    positional reads (os.pread). Not np.memmap: random windows through a memory map grew the
    trainer's RSS with the corpus (each page fault maps its read-around neighbourhood from the
    page cache: +180 MB after 6,400 windows of a 200 MB corpus, measured by the parallel data
    branch); pread copies only the window, so the RSS stays flat whatever the corpus size."""

    def __init__(self, folder: str, meta: DataMeta, split: str):
        info = meta.splits.get(split)
        self.name = split
        self.dtype = dtype = np.dtype(meta.dtype)
        self.fds: list[int] = []
        lengths: list[int] = []
        for shard in info.shards if info else []:
            path = os.path.join(folder, shard.file)
            expected = shard.tokens * dtype.itemsize
            size = os.path.getsize(path) if os.path.isfile(path) else -1
            if size != expected:
                raise CorpusError(
                    f"shard {path!r} has {size} bytes, meta.json says {expected}: the folder is damaged; "
                    "prepare the data again"
                )
            if shard.tokens:
                self.fds.append(os.open(path, os.O_RDONLY))
                lengths.append(shard.tokens)
        self.lengths = lengths
        self.offsets = np.cumsum([0] + lengths)  # shard i starts at offsets[i]

    def __del__(self) -> None:
        for fd in getattr(self, "fds", []):
            try:
                os.close(fd)
            except OSError:
                pass

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens start .. start+length-1 as int64, read across shard edges."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window {start}..{start + length} outside the {len(self)} tokens of {self.name}")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        filled = 0
        while filled < length:
            local = start + filled - int(self.offsets[shard])
            take = min(length - filled, self.lengths[shard] - local)
            size = self.dtype.itemsize
            raw = os.pread(self.fds[shard], take * size, local * size)
            out[filled : filled + take] = np.frombuffer(raw, dtype=self.dtype)
            filled += take
            shard += 1
        return out


class PreparedData:
    """An opened data folder: its meta, the tokenizer's path and both splits."""

    def __init__(self, folder: str):
        self.folder = folder
        self.meta = read_meta(folder)
        self.tokenizer_path = os.path.join(folder, TOKENIZER)
        self.train = TokenSplit(folder, self.meta, "train")
        self.val = TokenSplit(folder, self.meta, "val")

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size
