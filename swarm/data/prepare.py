"""`swarm data prepare INPUT... --out DIR`: a user's corpus -> a tokenizer and token shards.

Two passes over the input when a BPE is trained (one to fit the tokenizer, one to encode), one
otherwise. Documents go to the validation split by a hash of their text (stable whatever the order
of the inputs); shards, then tokenizer.json, then meta.json last (atomically) are written into DIR.
Running it again on the same inputs with the same options reuses the folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

from process.config import ConfigError, option
from swarm.data.shards import (
    FORMAT,
    META,
    TOKENIZER,
    TOKENIZER_CONFIG,
    VERSION,
    DataMeta,
    InputInfo,
    ShardWriter,
    read_meta,
    write_meta,
)
from swarm.data.sources import CorpusError, InputFile, ReadStats, file_sha256, iter_documents, list_inputs
from swarm.data.tokenizer import (
    DocumentEncoder,
    TokenizerSpec,
    byte_tokenizer,
    load_tokenizer_file,
    token_dtype,
    train_bpe,
    transformers_tokenizer_config,
)

ENCODE_BATCH_DOCUMENTS = 256
# A BPE is fitted to the first this-many characters of the input: its merges settle long before
# (the parallel data branch measured 200 MB at 0.35 MB/s when the BPE was fitted to all of it).
BPE_TRAIN_MAX_CHARS = 32 << 20


@dataclasses.dataclass(kw_only=True)
class PrepareConfig:
    inputs: list[str] = option(default_factory=list, help="text files, folders and .jsonl(.gz) files")
    out: str = option("", help="folder to write the prepared dataset into")
    tokenizer: str = option("bpe:8192", help="bytes, bpe:VOCAB (trained on the input), or a tokenizer.json path")
    val_fraction: float = option(0.05, help="fraction of documents held out for validation")
    text_field: str = option("text", help="field of each .jsonl line that holds the document's text")

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("--out DIR is required: the folder the prepared dataset is written to")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction {self.val_fraction}: use a fraction in [0, 1)")


def goes_to_validation(document: str, val_fraction: float) -> bool:
    """A document's split, from a hash of its text: the same document always lands in the same split."""
    digest = hashlib.blake2b(document.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < val_fraction


def _with_last_flag(items: Iterator[str]) -> Iterator[tuple[str, bool]]:
    previous, has_previous = None, False
    for item in items:
        if has_previous:
            yield previous, False
        previous, has_previous = item, True
    if has_previous:
        yield previous, True


class _Progress:
    """A bar over the input's bytes on a terminal; plain start/end lines elsewhere."""

    def __init__(self, total: int, what: str, say: Callable[[str], None]):
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=not self.interactive)
        if not self.interactive:
            say(f"{what}: {total / 1e6:.1f} MB...")

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _reusable(out: str, inputs: list[InputInfo], config: PrepareConfig, spec: TokenizerSpec) -> DataMeta | None:
    if not os.path.isfile(os.path.join(out, META)):
        return None
    meta = read_meta(out)  # a foreign or older folder is refused here rather than overwritten
    same = (
        meta.inputs == inputs
        and meta.tokenizer == spec.describe()
        and meta.val_fraction == config.val_fraction
        and meta.text_field == config.text_field
    )
    return meta if same else None


def _parent(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    return parent


@contextlib.contextmanager
def _preparing_alone(out: str, say: Callable[[str], None]) -> Iterator[None]:
    """Held from the check for a reusable folder to its last write: a second prepare of the same
    folder (two trainers started at once on one file) waits, then finds it prepared, instead of
    clearing the files the first one's readers have begun to use. The lock is an advisory one on
    the parent folder, so that no lock file is left behind; a prepare into another folder of the
    same parent waits too. On a file system without locks, none is taken."""
    parent = _parent(out)
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process that prepares data in {parent}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no locks here
        yield
    finally:
        os.close(fd)  # and with it the lock


def _clear_own_files(out: str, dry_run: bool = False) -> None:
    """Remove what an earlier (or interrupted) prepare wrote; refuse a folder holding anything else."""
    ours = [
        n
        for n in os.listdir(out)
        if n.endswith(".bin") or n in (META, TOKENIZER, TOKENIZER_CONFIG) or n.startswith(META + ".tmp")
    ]
    others = sorted(set(os.listdir(out)) - set(ours))
    if others:
        raise CorpusError(
            f"--out {out!r} holds other files ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
            "give an empty or new folder"
        )
    for name in [] if dry_run else ours:
        os.remove(os.path.join(out, name))


def prepare(config: PrepareConfig, say: Callable[[str], None] = print) -> DataMeta:
    """Prepare `config.inputs` into `config.out`; returns its meta (reused if already prepared)."""
    spec = TokenizerSpec.parse(config.tokenizer)
    files = list_inputs(config.inputs)
    total = sum(f.size for f in files)
    inputs = [InputInfo(path=os.path.abspath(f.path), bytes=f.size, sha256=file_sha256(f.path)) for f in files]
    with _preparing_alone(config.out, say):
        return _prepare_unless_reusable(config, spec, files, inputs, total, say)


def _prepare_unless_reusable(
    config: PrepareConfig,
    spec: TokenizerSpec,
    files: list[InputFile],
    inputs: list[InputInfo],
    total: int,
    say: Callable[[str], None],
) -> DataMeta:
    reused = _reusable(config.out, inputs, config, spec)
    if reused is not None:
        say(f"{config.out} already holds this corpus prepared ({describe(reused)}); reusing it")
        return reused
    if os.path.isdir(config.out):
        _clear_own_files(config.out, dry_run=True)  # refuse a folder holding anything else before the work
    started = time.perf_counter()
    # Built in a folder of its own beside DIR, then moved in (meta.json last): an interrupted run
    # leaves DIR as it was. A second run on the same DIR waits for this one (_preparing_alone).
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(config.out))}.", dir=_parent(config.out))
    try:
        if spec.scheme == "bytes":
            tokenizer = byte_tokenizer()
        elif spec.scheme == "file":
            tokenizer = load_tokenizer_file(spec.path)
        else:
            sample = min(total, BPE_TRAIN_MAX_CHARS)
            progress = _Progress(
                sample, f"training a {spec.vocab_size}-token BPE on the first {sample / 1e6:.0f} MB", say
            )
            documents = _counted(iter_documents(files, text_field=config.text_field), progress, BPE_TRAIN_MAX_CHARS)
            tokenizer = train_bpe(documents, spec.vocab_size)
            progress.close()
        meta = _encode(config, spec, files, inputs, tokenizer, work, say)
        tokenizer.save(os.path.join(work, TOKENIZER))
        with open(os.path.join(work, TOKENIZER_CONFIG), "w") as f:
            json.dump(transformers_tokenizer_config(tokenizer), f, indent=2)
        os.makedirs(config.out, exist_ok=True)
        _clear_own_files(config.out)
        for name in sorted(os.listdir(work)):
            os.replace(os.path.join(work, name), os.path.join(config.out, name))
        write_meta(config.out, meta)  # last: its presence says the folder is complete
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - started
    say(f"prepared {config.out}: {describe(meta)} in {elapsed:.1f} s ({total / 1e6 / max(elapsed, 1e-9):.1f} MB/s)")
    if meta.skipped_lines:
        skipped = ", ".join(f"{count} {reason}" for reason, count in meta.skipped_lines.items())
        say(f"skipped jsonl lines: {skipped}")
    return meta


def _counted(documents: Iterator[str], progress: _Progress, limit: int) -> Iterator[str]:
    seen = 0
    for document in documents:
        progress.update(len(document))
        yield document
        seen += len(document)
        if seen >= limit:
            return


def _encode(config, spec, files: list[InputFile], inputs: list[InputInfo], tokenizer, folder: str, say) -> DataMeta:
    encoder = DocumentEncoder(tokenizer, raw_bytes=spec.scheme == "bytes")
    dtype = token_dtype(encoder.vocab_size)
    writers = {split: ShardWriter(folder, split, dtype) for split in ("train", "val")}
    stats = ReadStats()
    progress = _Progress(sum(f.size for f in files), "tokenizing", say)
    batch: list[tuple[str, str]] = []

    def flush() -> None:
        for (split, _), ids in zip(batch, encoder.encode([text for _, text in batch])):
            writers[split].write(ids)
        batch.clear()

    for document, is_last in _with_last_flag(iter_documents(files, text_field=config.text_field, stats=stats)):
        to_val = goes_to_validation(document, config.val_fraction)
        if (
            is_last
            and config.val_fraction > 0
            and writers["val"].documents == 0
            and not any(s == "val" for s, _ in batch)
        ):
            to_val = stats.documents > 1  # hold out at least one document when there are two
        batch.append(("val" if to_val else "train", document))
        progress.update(len(document))
        if len(batch) >= ENCODE_BATCH_DOCUMENTS:
            flush()
    flush()
    progress.close()
    splits = {name: writer.close() for name, writer in writers.items()}
    if stats.documents == 0:
        raise CorpusError(
            f"the input ({', '.join(config.inputs)}) holds no documents (skipped: {stats.skipped} jsonl lines)"
        )
    return DataMeta(
        format=FORMAT,
        version=VERSION,
        vocab_size=encoder.vocab_size,
        dtype=dtype.name,
        tokenizer=spec.describe(),
        val_fraction=config.val_fraction,
        text_field=config.text_field,
        documents=stats.documents,
        skipped_lines=stats.skipped_lines,
        inputs=inputs,
        splits=splits,
    )


def describe(meta: DataMeta) -> str:
    train, val = meta.splits["train"], meta.splits["val"]
    return (
        f"{meta.documents:,} documents, vocabulary {meta.vocab_size:,} ({meta.tokenizer}), {meta.dtype}; "
        f"train {train.tokens:,} tokens ({train.documents} documents), val {val.tokens:,} tokens ({val.documents} documents)"
    )


def run_prepare(config: PrepareConfig) -> int:
    prepare(config)
    return 0
