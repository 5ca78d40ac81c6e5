"""`swarm data prepare INPUT... --out DIR`: documents -> tokenizer -> token shards + meta.json.

Documents are assigned to the validation split by position (every 1/F-th document, evenly spread,
so the val split is held out by document, never by window). Everything is written into a sibling
folder `DIR.partial-PID`, meta.json last, then swapped into place: an interrupted prepare leaves
no folder that looks complete. A re-run whose inputs (by content hash) and options are the same
reuses DIR as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys

from process.config import ConfigError, option
from swarm.data.errors import DataError
from swarm.data.shards import (
    DEFAULT_SHARD_TOKENS,
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    TOKENIZER_FILE,
    DataMeta,
    InputInfo,
    ShardWriter,
    read_meta,
    write_meta,
)
from swarm.data.sources import SourceStats, file_hash, input_files, read_documents
from swarm.data.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    TextEncoder,
    TokenizerSpec,
    build_tokenizer,
    token_dtype,
    tokenizer_config,
)

ENCODE_BATCH_BYTES = 4 << 20  # text handed to the tokenizer at once
# A BPE is fitted to at most this much text (the first documents): on 2 busy cores it trained at
# ~0.8 MB/s, so 200 MB took minutes for merges that 32 MB of the same text already settles.
BPE_TRAIN_MAX_BYTES = 32 << 20


@dataclasses.dataclass(kw_only=True)
class PrepareConfig:
    inputs: list[str] = option(default_factory=list, help="text files, folders, .jsonl or .jsonl.gz files")
    out: str = option("", help="folder to write the prepared dataset to")
    tokenizer: str = option("bytes", help="bytes, bpe:VOCAB (trained on the inputs), or a tokenizer.json file")
    val_fraction: float = option(0.1, help="fraction of the documents held out for validation")
    text_field: str = option("text", help="field holding a document's text in .jsonl inputs")
    shard_tokens: int = option(DEFAULT_SHARD_TOKENS, help="tokens per shard file")

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("--out DIR is required")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("--val-fraction must lie in [0, 1)")
        if self.shard_tokens < 1:
            raise ConfigError("--shard-tokens must be at least 1")


def is_validation_document(index: int, val_fraction: float) -> bool:
    """Every 1/F-th document (0-based `index`) goes to validation: floor((i+1)F) > floor(iF)."""
    return math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not sys.stderr.isatty(), leave=False)


def prepare(config: PrepareConfig, say=print) -> DataMeta:
    """Prepare (or reuse) `config.out`; returns its meta."""
    spec = TokenizerSpec.parse(config.tokenizer)
    files = input_files(config.inputs)
    inputs = [InputInfo(path=os.path.abspath(p), bytes=os.path.getsize(p), sha256=file_hash(p)) for p in files]
    if sum(i.bytes for i in inputs) == 0:
        raise DataError("every input is empty: there is no text to prepare")
    recipe = _recipe(inputs, spec, config)
    if os.path.isfile(os.path.join(config.out, META_FILE)):
        try:
            existing = read_meta(config.out)
            if existing.recipe == recipe:
                say(f"{config.out}: already prepared from the same inputs and options; reusing it")
                return existing
        except DataError:
            pass  # a broken or older folder: prepared again below
    elif os.path.isdir(config.out) and os.listdir(config.out):
        raise DataError(f"--out {config.out!r} exists and is not a prepared dataset; choose another folder")
    partial = f"{os.path.abspath(config.out).rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        meta = _prepare_into(partial, files, inputs, spec, config, recipe, say)
        _swap_into_place(partial, config.out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _recipe(inputs: list[InputInfo], spec: TokenizerSpec, config: PrepareConfig) -> str:
    tokenizer = spec.describe() if spec.kind != "file" else f"file:{file_hash(spec.path)}"
    payload = {
        "version": FORMAT_VERSION,
        "inputs": [(i.sha256, i.bytes) for i in inputs],
        "tokenizer": tokenizer,
        "val_fraction": config.val_fraction,
        "text_field": config.text_field,
        "shard_tokens": config.shard_tokens,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _prepare_into(partial, files, inputs, spec, config, recipe, say) -> DataMeta:
    total_bytes = sum(i.bytes for i in inputs)

    def training_documents():
        seen = 0
        bar = _progress(min(total_bytes, BPE_TRAIN_MAX_BYTES), f"training {spec.describe()}")
        for doc in read_documents(files, text_field=config.text_field):
            yield doc
            seen += len(doc)
            bar.update(len(doc))
            if seen >= BPE_TRAIN_MAX_BYTES:
                break
        bar.close()

    if spec.kind == "bpe":
        say(f"training a byte-level BPE of {spec.vocab_size} tokens on the inputs")
    tokenizer, is_bytes = build_tokenizer(spec, training_documents)
    encoder = TextEncoder(tokenizer, is_bytes=is_bytes)
    dtype = token_dtype(encoder.vocab_size)
    writers = {s: ShardWriter(partial, s, dtype, config.shard_tokens) for s in ("train", "val")}
    stats = SourceStats()
    bar = _progress(total_bytes, "tokenizing")
    pending: list[tuple[int, str]] = []

    def flush():
        for (index, _), ids in zip(pending, encoder.encode([doc for _, doc in pending])):
            writer = writers["val" if is_validation_document(index, config.val_fraction) else "train"]
            writer.write(ids)
            writer.documents += 1
        pending.clear()

    index, pending_bytes = 0, 0
    for path, info in zip(files, inputs):
        for doc in read_documents([path], text_field=config.text_field, stats=stats):
            pending.append((index, doc))
            index += 1
            pending_bytes += len(doc)
            if pending_bytes >= ENCODE_BATCH_BYTES:
                flush()
                pending_bytes = 0
        bar.update(info.bytes)
    flush()
    bar.close()
    if stats.bad_lines:
        say(
            f"skipped {stats.bad_lines} jsonl lines that are not JSON or lack the {config.text_field!r} field "
            f"(e.g. {stats.bad_line_examples[0]})"
        )
    if stats.documents == 0:
        raise DataError(f"the inputs hold no document (no text; {stats.bad_lines} jsonl lines skipped)")
    splits = {name: writer.close() for name, writer in writers.items()}
    if splits["train"].tokens < 2:
        raise DataError("the inputs hold too little text to train on")
    if config.val_fraction > 0 and splits["val"].documents == 0:
        say(f"note: {stats.documents} documents are too few to hold out {config.val_fraction:.0%}; no validation split")
    tokenizer.save(os.path.join(partial, TOKENIZER_FILE))
    with open(os.path.join(partial, TOKENIZER_CONFIG_FILE), "w") as f:  # for transformers' AutoTokenizer
        json.dump(tokenizer_config(encoder), f, indent=2)
    meta = DataMeta(
        format=FORMAT,
        version=FORMAT_VERSION,
        vocab_size=encoder.vocab_size,
        dtype=dtype.name,
        tokenizer=spec.describe(),
        eos_id=encoder.eos_id,
        documents=stats.documents,
        text_bytes=stats.text_bytes,
        bad_lines=stats.bad_lines,
        val_fraction=config.val_fraction,
        text_field=config.text_field,
        splits=splits,
        inputs=inputs,
        recipe=recipe,
    )
    write_meta(partial, meta)  # last: a folder with meta.json is complete
    say(
        f"prepared {stats.documents} documents ({stats.text_bytes / 1e6:.1f} MB of text): "
        f"{splits['train'].tokens:,} train and {splits['val'].tokens:,} val tokens, vocabulary "
        f"{encoder.vocab_size} ({dtype.name})"
    )
    return meta


def _swap_into_place(partial: str, out: str) -> None:
    """Replace `out` by the complete `partial` folder (an older prepared `out` is removed after)."""
    old = None
    if os.path.exists(out):
        old = f"{os.path.abspath(out).rstrip(os.sep)}.old-{os.getpid()}"
        os.replace(out, old)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(partial, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def run_prepare(config: PrepareConfig) -> int:
    meta = prepare(config)
    print(f"{config.out}: vocab_size {meta.vocab_size}, tokenizer {meta.tokenizer}", flush=True)
    return 0
