"""Sockets that a killed process left in /tmp, removed by the next process that starts.

hivemind's P2P listens on two unix sockets, `/tmp/hivemind-p2pd-*.sock` (the daemon's) and
`/tmp/hivemind-p2pclient-*.sock` (the Python side's), and removes them when it shuts down. A role
stopped with SIGKILL (the OOM killer, `docker kill`, a test's kill) runs no cleanup, and its `p2pd`
dies by its parent-death signal (process/lifetime.py), so both files stay: a clean-clone test run
left a dozen. Nothing can remove them at the moment of the kill, so every role removes, when it
starts, the ones that are provably dead:

- the name is hivemind's pattern and the file is a socket owned by this user;
- it is older than `min_age_s`, so a process that is just starting is never raced;
- no socket of any process holds its path: the path is in no network namespace's `/proc/<pid>/net/unix`
  (every namespace is read, since `benchmarks/wan.py` runs peers in namespaces of their own over the
  same /tmp). The check never connects: hivemind's side logs a traceback for a connection that
  closes before it says which stream it is.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

logger = logging.getLogger(__name__)

HIVEMIND_SOCKET_DIR = Path("/tmp")  # hivemind's P2P._UNIX_SOCKET_PREFIX: not configurable
HIVEMIND_SOCKET_PATTERNS = ("hivemind-p2pd-*.sock", "hivemind-p2pclient-*.sock")
MIN_AGE_S = 60.0


def bound_unix_paths(proc: Path = Path("/proc")) -> set[str] | None:
    """The paths of every unix socket bound in any network namespace this user can read, or None
    when none can be read (no /proc): then nothing is known to be stale."""
    namespaces: set[str] = set()
    paths: set[str] = set()
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            namespace = os.readlink(entry / "ns" / "net")
            if namespace in namespaces:
                continue
            table = (entry / "net" / "unix").read_text()
        except OSError:  # the process ended, or it is not ours to read
            continue
        namespaces.add(namespace)
        for line in table.splitlines()[1:]:  # Num RefCount Protocol Flags Type St Inode Path
            fields = line.split(None, 7)
            if len(fields) == 8:
                paths.add(fields[7])
    return paths if namespaces else None


def remove_stale_sockets(
    directory: Path = HIVEMIND_SOCKET_DIR,
    patterns: tuple[str, ...] = HIVEMIND_SOCKET_PATTERNS,
    min_age_s: float = MIN_AGE_S,
) -> list[Path]:
    """Remove the sockets in `directory` matching `patterns` that no socket holds; return them.
    /proc is read only when an old enough socket of this user is there (usually none is)."""
    now, uid = time.time(), os.getuid()
    candidates = []
    for pattern in patterns:
        for path in directory.glob(pattern):
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(info.st_mode) and info.st_uid == uid and now - info.st_mtime >= min_age_s:
                candidates.append(path)
    bound = bound_unix_paths() if candidates else None
    if bound is None:
        return []
    removed = []
    for path in candidates:
        if str(path) in bound:
            continue
        try:
            path.unlink()
        except OSError as e:  # gone already, or not ours to remove
            logger.debug("could not remove the stale socket %s: %s", path, e)
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d socket(s) that killed processes left in %s", len(removed), directory)
    return removed
