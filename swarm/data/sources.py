"""The corpus a user brings, read as documents.

INPUT is any mix of text files, folders (read recursively, hidden entries skipped) and `.jsonl` /
`.jsonl.gz` files (one JSON object per line, its text under `text_field`). A text file is split
into documents at blank lines, grouped up to `TEXT_DOCUMENT_CHARS` characters, so that a corpus of
a few long files still has documents to hold out for validation. A jsonl line that is not JSON, or
lacks the text field, is counted and skipped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

TEXT_DOCUMENT_CHARS = 64 << 10
_BLANK_LINES = re.compile(r"\n\s*\n")


class CorpusError(ValueError):
    """The corpus cannot be read or is too small to train on (one line a user can act on)."""


@dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # "text" or "jsonl"
    size: int


@dataclass
class ReadStats:
    documents: int = 0
    characters: int = 0
    bytes_read: int = 0
    skipped_lines: dict[str, int] = field(default_factory=dict)  # reason -> count

    def skip(self, reason: str) -> None:
        self.skipped_lines[reason] = self.skipped_lines.get(reason, 0) + 1

    @property
    def skipped(self) -> int:
        return sum(self.skipped_lines.values())


def _kind(path: str) -> str:
    return "jsonl" if path.endswith((".jsonl", ".jsonl.gz")) else "text"


def list_inputs(inputs: list[str]) -> list[InputFile]:
    """The files behind INPUT..., in a stable order; raises CorpusError for a missing or empty input."""
    if not inputs:
        raise CorpusError("no input given: pass text files, folders or .jsonl(.gz) files")
    files: list[InputFile] = []
    for item in inputs:
        if os.path.isdir(item):
            found = []
            for root, dirs, names in os.walk(item):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
            if not found:
                raise CorpusError(f"input folder {item!r} holds no files")
            paths = found
        elif os.path.isfile(item):
            paths = [item]
        else:
            raise CorpusError(f"input {item!r} does not exist")
        for path in paths:
            try:
                size = os.path.getsize(path)
            except OSError as e:
                raise CorpusError(f"cannot read input {path!r}: {e.strerror}") from None
            files.append(InputFile(path=path, kind=_kind(path), size=size))
    if sum(f.size for f in files) == 0:
        raise CorpusError(f"the input ({', '.join(inputs)}) is empty")
    return files


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        raise CorpusError(f"cannot read input {path!r}: {e.strerror}") from None
    return digest.hexdigest()


def split_text(text: str, max_chars: int = TEXT_DOCUMENT_CHARS) -> list[str]:
    """A text file's documents: paragraphs (split at blank lines) grouped up to `max_chars`."""
    documents, current, size = [], [], 0
    for paragraph in _BLANK_LINES.split(text):
        if not paragraph.strip():
            continue
        if current and size + len(paragraph) > max_chars:
            documents.append("\n\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += len(paragraph) + 2
    if current:
        documents.append("\n\n".join(current))
    return documents


def _read_text(file: InputFile) -> Iterator[str]:
    try:
        with open(file.path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CorpusError(f"cannot read input {file.path!r}: {e.strerror}") from None
    yield from split_text(data.decode("utf-8", errors="replace"))


def _read_jsonl(file: InputFile, text_field: str, stats: ReadStats) -> Iterator[str]:
    opener = gzip.open if file.path.endswith(".gz") else open
    try:
        with opener(file.path, "rt", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    stats.skip("not JSON")
                    continue
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    stats.skip(f"no {text_field!r} text field")
                    continue
                if text.strip():
                    yield text
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise CorpusError(f"cannot read input {file.path!r}: {getattr(e, 'strerror', None) or e}") from None


def iter_documents(
    files: list[InputFile], *, text_field: str = "text", stats: ReadStats | None = None
) -> Iterator[str]:
    """Every document of every file, in order; counts into `stats` (documents, characters, bytes,
    skipped jsonl lines)."""
    stats = stats if stats is not None else ReadStats()
    for file in files:
        documents = _read_jsonl(file, text_field, stats) if file.kind == "jsonl" else _read_text(file)
        for document in documents:
            stats.documents += 1
            stats.characters += len(document)
            yield document
        stats.bytes_read += file.size
