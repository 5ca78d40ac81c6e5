"""The three tokenizer schemes of `swarm data prepare --tokenizer`:

- `bytes`: one token per UTF-8 byte (vocabulary 256), the project's original scheme;
- `bpe:VOCAB`: a byte-level BPE trained on the input with Hugging Face `tokenizers` (no download),
  with `<|endoftext|>` between documents;
- a path to an existing `tokenizer.json`.

Whatever the scheme, the prepared folder holds a `tokenizer.json` that `tokenizers.Tokenizer` and
`transformers.AutoTokenizer` load; for `bytes` it is a BPE with no merges over GPT-2's byte
alphabet, so that it encodes every text to exactly its UTF-8 bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from swarm.data.sources import CorpusError

END_OF_TEXT = "<|endoftext|>"
_EOS_NAMES = (END_OF_TEXT, "</s>", "<eos>", "<|end_of_text|>")
MIN_BPE_VOCAB = 260  # the 256 byte symbols, the end-of-text token, and a few merges
MAX_VOCAB = 1 << 31
PIECE_CHARS = 4096


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what byte-level BPE works on)."""
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
    """A `tokenizers` BPE without merges whose token id is the byte's value."""
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@dataclass(frozen=True)
class TokenizerSpec:
    """What `--tokenizer` asked for: scheme "bytes", "bpe" (with vocab_size) or "file" (with path)."""

    scheme: str
    vocab_size: int | None = None
    path: str | None = None

    @classmethod
    def parse(cls, value: str) -> TokenizerSpec:
        if value == "bytes":
            return cls("bytes", 256)
        if value.startswith("bpe:"):
            try:
                vocab = int(value[4:])
            except ValueError:
                raise CorpusError(f"--tokenizer {value!r}: write bpe:VOCAB with an integer, e.g. bpe:8192") from None
            if not MIN_BPE_VOCAB <= vocab <= MAX_VOCAB:
                raise CorpusError(f"--tokenizer {value!r}: a BPE vocabulary needs at least {MIN_BPE_VOCAB} tokens")
            return cls("bpe", vocab)
        if os.path.isdir(value) and os.path.isfile(os.path.join(value, "tokenizer.json")):
            value = os.path.join(value, "tokenizer.json")
        if not os.path.isfile(value):
            raise CorpusError(f"--tokenizer {value!r}: use bytes, bpe:VOCAB, or the path of a tokenizer.json")
        return cls("file", path=os.path.abspath(value))

    def describe(self) -> str:
        return {"bytes": "bytes", "bpe": f"bpe:{self.vocab_size}"}.get(self.scheme) or f"file:{self.path}"


def load_tokenizer_file(path: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for every parse error
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorpusError(f"tokenizer {path!r} does not parse as a tokenizer.json: {first}") from None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (including `<|endoftext|>`) trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def end_of_text_token(tokenizer: Tokenizer) -> str | None:
    """The tokenizer's end-of-text token (the document separator), if it has one."""
    return next((name for name in _EOS_NAMES if tokenizer.token_to_id(name) is not None), None)


def transformers_tokenizer_config(tokenizer: Tokenizer) -> dict:
    """tokenizer_config.json: so that transformers' AutoTokenizer loads the folder as a fast
    tokenizer that knows its end-of-text token (without it, eos_token is None)."""
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    eos = end_of_text_token(tokenizer)
    if eos is not None:
        config["eos_token"] = eos
    return config


class DocumentEncoder:
    """Encodes documents to token ids, each followed by the separator (end-of-text, or a blank
    line for tokenizers that have none)."""

    def __init__(self, tokenizer: Tokenizer, *, raw_bytes: bool = False):
        self.tokenizer, self.raw_bytes = tokenizer, raw_bytes
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = next(
            (tokenizer.token_to_id(name) for name in _EOS_NAMES if tokenizer.token_to_id(name) is not None), None
        )
        self.separator = np.array([eos] if eos is not None else self._encode_one("\n\n"), dtype=np.int64)

    def _encode_one(self, text: str) -> list[int]:
        if self.raw_bytes:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, documents: list[str]) -> Iterator[np.ndarray]:
        """One int64 array per document, the separator appended."""
        if self.raw_bytes:  # the byte tokenizer's ids are the bytes: skip the tokenizer (same ids, faster)
            for doc in documents:
                yield np.concatenate(
                    [np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int64), self.separator]
                )
            return
        # Long strings encode slowly (measured: a 2 MB batch of 64 KB documents took 3.8x as long as
        # the same text in lines), so each document is cut into pieces at boundaries the byte-level
        # pre-tokenizer splits at anyway: the ids are those of the whole document.
        pieces = [split_at_safe_boundaries(doc) for doc in documents]
        encodings = iter(self.tokenizer.encode_batch_fast([p for ps in pieces for p in ps], add_special_tokens=False))
        for ps in pieces:
            ids = [np.asarray(next(encodings).ids, dtype=np.int64) for _ in ps]
            yield np.concatenate([*ids, self.separator])


_SAFE_BOUNDARY = re.compile(r"(?<=\S\n)(?=\S)")


def split_at_safe_boundaries(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of about `piece_chars`, cut only after a newline that has a non-space on
    both sides: GPT-2's pre-tokenizer regex ends a token there whatever follows, so encoding the
    pieces gives the ids of the whole text."""
    if len(text) <= piece_chars:
        return [text]
    pieces, current, size = [], [], 0
    for part in _SAFE_BOUNDARY.split(text):
        current.append(part)
        size += len(part)
        if size >= piece_chars:
            pieces.append("".join(current))
            current, size = [], 0
    if current:
        pieces.append("".join(current))
    return pieces


def token_dtype(vocab_size: int) -> np.dtype:
    """The most compact unsigned integer dtype that holds every token id."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)
