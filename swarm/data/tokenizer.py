"""The tokenizer of a prepared dataset, always stored as a Hugging Face `tokenizer.json` (loadable
with `tokenizers.Tokenizer.from_file` and transformers' `AutoTokenizer`/`PreTrainedTokenizerFast`):

- `bytes`: one token per byte, ids 0..255 (a byte-level BPE with no merges, so that the file
  encodes and decodes exactly like the fast path below);
- `bpe:VOCAB`: a byte-level BPE trained on the inputs with `tokenizers` (no download), with an
  end-of-text token that separates documents;
- a path to an existing `tokenizer.json`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from swarm.data.errors import DataError

EOS_TOKEN = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # the 256 byte symbols and the end-of-text token
MAX_VOCAB = 1 << 24
PARAGRAPH = re.compile(r"(?<=\n\n)")  # splits after each blank line, keeping it


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "bytes", "bpe" or "file"
    vocab_size: int = 256  # bpe: the requested size
    path: str = ""  # file: the tokenizer.json

    @classmethod
    def parse(cls, text: str) -> TokenizerSpec:
        if text == "bytes":
            return cls("bytes")
        if text.startswith("bpe:"):
            try:
                vocab = int(text[4:])
            except ValueError:
                raise DataError(f"--tokenizer {text!r}: expected bpe:VOCAB with an integer VOCAB") from None
            if not MIN_BPE_VOCAB <= vocab <= MAX_VOCAB:
                raise DataError(f"--tokenizer {text!r}: VOCAB must lie in {MIN_BPE_VOCAB}..{MAX_VOCAB}")
            return cls("bpe", vocab)
        if os.path.isfile(text):
            return cls("file", path=os.path.abspath(text))
        raise DataError(f"--tokenizer {text!r}: use bytes, bpe:VOCAB or the path of a tokenizer.json")

    def describe(self) -> str:
        return {"bytes": "bytes", "bpe": f"bpe:{self.vocab_size}", "file": self.path}[self.kind]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> Tokenizer:
    """Token id = byte value, for every byte: a byte-level BPE with the 256 byte symbols and no merges."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (the end-of-text token included) fitted to `documents`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def load_tokenizer_file(path: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"tokenizer file {path!r} does not parse as a tokenizer.json: {first_line}") from None


class TextEncoder:
    """Documents -> token ids, with the end-of-text id (if any) after each document."""

    def __init__(self, tokenizer: Tokenizer, *, is_bytes: bool):
        self.tokenizer, self.is_bytes = tokenizer, is_bytes
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = None if is_bytes else tokenizer.token_to_id(EOS_TOKEN)

    def encode(self, documents: list[str]) -> list[np.ndarray]:
        if self.is_bytes:  # the fast path: the same ids as the byte tokenizer.json gives
            return [np.frombuffer(doc.encode("utf-8", errors="replace"), dtype=np.uint8) for doc in documents]
        # Encoded paragraph by paragraph: a 4 MB document in one piece encoded at half the speed (the
        # tokenizer parallelises over pieces). The text round-trips either way (byte-level).
        pieces, owners = [], []
        for index, doc in enumerate(documents):
            for piece in PARAGRAPH.split(doc):
                if piece:
                    pieces.append(piece)
                    owners.append(index)
        ids: list[list[int]] = [[] for _ in documents]
        for owner, encoding in zip(owners, self.tokenizer.encode_batch(pieces, add_special_tokens=False)):
            ids[owner] += encoding.ids
        eos = [self.eos_id] if self.eos_id is not None else []
        return [np.asarray(doc_ids + eos, dtype=np.uint32) for doc_ids in ids]


def build_tokenizer(spec: TokenizerSpec, training_documents) -> tuple[Tokenizer, bool]:
    """(tokenizer, is_bytes); `training_documents()` yields the documents a BPE is fitted to."""
    if spec.kind == "bytes":
        return byte_tokenizer(), True
    if spec.kind == "bpe":
        return train_bpe(training_documents(), spec.vocab_size), False
    tokenizer = load_tokenizer_file(spec.path)
    if tokenizer.get_vocab_size(with_added_tokens=True) < 1:
        raise DataError(f"tokenizer file {spec.path!r} has an empty vocabulary")
    return tokenizer, False


TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def tokenizer_config(encoder: TextEncoder) -> dict:
    """What transformers' AutoTokenizer reads beside tokenizer.json: the class and the end-of-text token."""
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if encoder.eos_id is not None:
        config["eos_token"] = encoder.tokenizer.id_to_token(encoder.eos_id)
    return config


def token_dtype(vocab_size: int) -> np.dtype:
    """The most compact unsigned integer type that holds every id of the vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)
