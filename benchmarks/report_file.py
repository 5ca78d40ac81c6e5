"""Where every benchmark's figures go: one JSON report, written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(path: str | os.PathLike, report: Any, *, indent: int = 2) -> None:
    """Write `report` as JSON to `path` (parent folders made; a temporary file renamed into place,
    so an interrupted run never leaves half a report) and print where it went."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=indent) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}", flush=True)
