"""CPU seconds by kind of process over a stretch of a benchmark: where a swarm's CPU goes.

A benchmark that starts a `LocalSwarm` in this process takes a `snapshot` before the stretch (after
the peers are online, before the trainer starts) and another after it (the trainer has exited), and
`cpu_spent` gives the CPU (user + system) each kind of process took in between:

* `peers`: the peer processes themselves (compute, RPC handlers, the commit's copies);
* `peer helpers`: the processes a peer forks (hivemind's DHT process and, with averaging, the
  averager's process, which runs the all-reduce);
* `p2pd`: every libp2p daemon (the peers', their helpers', the bootstrap's);
* `trainer`: the trainer and what it started, read from this process's reaped-children times
  (the trainer has exited by the second snapshot);
* `bootstrap`: the bootstrap DHT node.

On a machine whose cores the swarm fills, the CPU a layout adds per step, against a layout without
it, is what it costs in throughput; this is how benchmarks/RESULTS.md splits that cost.
Processes that start and end inside the stretch are missed (none do in these benchmarks, but the
trainer's); a process's CPU is read with psutil, so a pid reused in between would be misread.
`tree_cpu_s(pid)` is one process tree's CPU, for benchmarks that split it by another rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

KINDS = ("peers", "peer helpers", "p2pd", "trainer", "bootstrap")


@dataclass(frozen=True)
class Snapshot:
    by_pid: dict[int, tuple[str, float]]  # pid: (kind, CPU seconds since it started)
    reaped_s: float  # CPU seconds of this process's children that have exited and been waited for


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process and its live descendants have used; 0 if it is gone."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for member in tree:
        try:
            total += _cpu_s(member)
        except psutil.Error:
            continue
    return total


def _kind_of_child(process: psutil.Process) -> str | None:
    """The kind of a process this benchmark started, from its command line (None: not the swarm's)."""
    words = process.cmdline()
    if "swarm.cli" not in words and not any(w.endswith("/swarm") for w in words):
        return None
    for word in words:
        if word in ("peer", "train", "dht"):
            return {"peer": "peers", "train": "trainer", "dht": "bootstrap"}[word]
    return None


def snapshot(root_pid: int | None = None) -> Snapshot:
    """Every process under `root_pid` (this process by default) that belongs to the swarm, by kind."""
    root = psutil.Process(root_pid or os.getpid())
    by_pid: dict[int, tuple[str, float]] = {}
    for child in root.children():
        try:
            kind = _kind_of_child(child)
            if kind is None:
                continue
            by_pid[child.pid] = (kind, _cpu_s(child))
            for descendant in child.children(recursive=True):
                name = "p2pd" if descendant.name() == "p2pd" else ("peer helpers" if kind == "peers" else kind)
                by_pid[descendant.pid] = (name, _cpu_s(descendant))
        except psutil.NoSuchProcess:
            continue
    own = os.times()
    return Snapshot(by_pid, own.children_user + own.children_system)


def cpu_spent(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds each kind took between two snapshots. A process only in `after` counts whole; one
    gone by `after` counts nothing, except the reaped children's times (the trainer's, here)."""
    spent = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, cpu) in after.by_pid.items():
        earlier = before.by_pid.get(pid)
        spent[kind] = spent.get(kind, 0.0) + cpu - (earlier[1] if earlier and earlier[0] == kind else 0.0)
    spent["trainer"] += after.reaped_s - before.reaped_s
    return {kind: round(seconds, 3) for kind, seconds in spent.items()}
