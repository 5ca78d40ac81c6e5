"""Documents from the inputs of `swarm data prepare`: text files (one document each), folders (read
recursively, hidden entries skipped) and `.jsonl` / `.jsonl.gz` files (one document per line, its
text under a field). A jsonl line that is not JSON, or lacks the field, is counted and skipped."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from swarm.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def is_jsonl(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES)


def input_files(inputs: list[str]) -> list[str]:
    """Every file named by `inputs` (files, folders read recursively), in a stable order."""
    if not inputs:
        raise DataError("no input given: name text files, folders, or .jsonl/.jsonl.gz files")
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = []
            for root, dirs, names in os.walk(item):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in names if not n.startswith(".")]
            if not found:
                raise DataError(f"input folder {item!r} holds no files")
            files += sorted(found)
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise DataError(f"input {item!r} does not exist")
    for path in files:
        if not os.access(path, os.R_OK):
            raise DataError(f"input {path!r} is not readable")
    return files


def file_hash(path: str) -> str:
    """sha256 of a file's bytes (what makes a re-run reuse a prepared folder)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as e:
        raise DataError(f"cannot read input {path!r}: {e.strerror}") from None
    return digest.hexdigest()


@dataclass
class SourceStats:
    documents: int = 0
    text_bytes: int = 0
    bad_lines: int = 0  # jsonl lines skipped: not JSON, not an object, or no text field
    bad_line_examples: list[str] = field(default_factory=list)

    def skip(self, where: str) -> None:
        self.bad_lines += 1
        if len(self.bad_line_examples) < 3:
            self.bad_line_examples.append(where)


def read_documents(files: list[str], *, text_field: str = "text", stats: SourceStats | None = None) -> Iterator[str]:
    """The documents of `files`, in order; empty documents are skipped."""
    stats = stats if stats is not None else SourceStats()
    for path in files:
        for text in _jsonl_documents(path, text_field, stats) if is_jsonl(path) else _text_document(path):
            if text:
                stats.documents += 1
                stats.text_bytes += len(text.encode("utf-8", errors="replace"))
                yield text


def _text_document(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()
    except OSError as e:
        raise DataError(f"cannot read input {path!r}: {e.strerror}") from None


def _jsonl_documents(path: str, text_field: str, stats: SourceStats) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    stats.skip(f"{path}:{number}: not JSON")
                    continue
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    stats.skip(f"{path}:{number}: no string field {text_field!r}")
                    continue
                yield text
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read input {path!r}: {getattr(e, 'strerror', None) or e}") from None
