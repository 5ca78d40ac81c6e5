"""Files a reader sees whole or not at all: write to `NAME.tmp.PID`, then rename over `NAME`.

A process killed mid-write (SIGKILL, the OOM killer) leaves its `NAME.tmp.PID` behind; nothing in
that process can remove it, so whoever writes `NAME` next calls `remove_stale_temporaries` at
start-up, which removes the temporaries of processes that are no longer running.
"""

from __future__ import annotations

import glob
import os

from process.lifetime import pid_alive


def write_atomically(path: str | os.PathLike, data: str | bytes, *, durable: bool = False) -> None:
    """Replace `path` with `data` in one rename; `durable` also flushes it to the disk first (for
    state that must survive a power cut: checkpoints, a corpus's meta). Creates the folder."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def remove_stale_temporaries(folder: str, pattern: str = "*.tmp.*") -> list[str]:
    """Remove temporary files (`NAME.tmp.PID`) that a killed process left in `folder`, except those
    of a process still running; returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), pattern)):
        owner = path.rsplit(".tmp.", 1)[-1]
        if owner.isdigit() and int(owner) != os.getpid() and pid_alive(int(owner)):
            continue
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed
