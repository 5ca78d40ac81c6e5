"""Exact sync's all-reduce over gloo (`--averaging-transport`): the round a trainer's commit names,
at the wire's cost. hivemind's averager spends about 14 ms of CPU per MB a replica on this machine
(protobuf, asyncio buffers, its process and p2pd); gloo's all-reduce about 1 ms (benchmarks/RESULTS.md).

- Every peer that can take such rounds runs one TCPStore server (the rendezvous of the rounds it
  leads) on its announced address (`PeerRecord.gloo`), and keeps a client to each leader it met.
- A round's members are the replicas the commit names; its leader is the first of them by peer
  id, whose address the trainer puts in the commit (`CommitRequest.gloo_rendezvous`). Each member
  builds a gloo process group under a prefix of the store made of the commit's step id and the
  members (a new group for every commit: nothing to agree on after a failure), all-reduces, and
  drops it. About 20 ms of set-up on loopback, a few round trips on a LAN.
- The mean is weighted by what the trainer saw each replica serve (the commit's samples, known to
  every member: nobody can weigh more than its count). In a group of three or more with robust
  averaging the members all-gather instead and each reduces every tensor robustly (robust_mean.py).
- Any error or the timeout fails the round on that member, as a failed hivemind round does.
gloo authenticates nobody: its store and its connections are open to whoever reaches the address.
So it is used only in a run without an authority (where hivemind's averager admits anyone too)
and on addresses a peer announces on purpose; with an authority the rounds go by exchange
(peers/replicas/sync_exchange.py), over the peers' authenticated transport.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import re
import threading
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from peers.replicas.robust_mean import robust_mean_by_segment

logger = logging.getLogger(__name__)


def announced_host(announce_maddrs: Sequence[str], host_maddrs: Sequence[str]) -> str | None:
    """The IPv4 address a peer's gloo rendezvous listens on: its first announced one, else the first
    it listens on; None when that is a wildcard (0.0.0.0: no one address to tell the others)."""
    for maddr in [*announce_maddrs, *host_maddrs]:
        match = re.match(r"^/ip4/([0-9.]+)/", maddr)
        if match:
            return None if match.group(1) == "0.0.0.0" else match.group(1)
    return None


def round_prefix(step_id: str, members: Sequence[str]) -> str:
    return hashlib.sha256("\n".join([step_id, *sorted(members)]).encode()).hexdigest()[:24] + "/"


class GlooRounds:
    """This peer's rendezvous server and its gloo rounds."""

    def __init__(self, host: str, *, port: int = 0, timeout_s: float = 30.0):
        self.host, self.timeout = host, datetime.timedelta(seconds=timeout_s)
        self.server = dist.TCPStore(host, port, None, True, timeout=self.timeout, wait_for_workers=False)
        self.address = f"{host}:{self.server.port}"
        self.clients: dict[str, dist.TCPStore] = {}
        self.lock = threading.Lock()

    def _store(self, leader: str) -> dist.Store:
        if leader == self.address:
            return self.server
        with self.lock:
            if leader not in self.clients:
                host, _, port = leader.rpartition(":")
                self.clients[leader] = dist.TCPStore(host, int(port), None, False, timeout=self.timeout)
            return self.clients[leader]

    def _group(self, leader: str, step_id: str, members: Sequence[str], me: str) -> dist.ProcessGroupGloo:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        options._timeout = self.timeout
        store = dist.PrefixStore(round_prefix(step_id, members), self._store(leader))
        return dist.ProcessGroupGloo(store, sorted(members).index(me), len(members), options)

    def average(
        self,
        flat: torch.Tensor,
        *,
        leader: str,
        step_id: str,
        me: str,
        weights: Mapping[str, float],
        robust: str = "none",
        tensor_sizes: Sequence[int] | None = None,
    ) -> bool:
        """Replace `flat` (this replica's mean gradient) with the members' weighted mean; False
        (`flat` then undefined) when the round failed."""
        members = sorted(weights)
        total = float(sum(weights.values()))
        if total <= 0:
            return False
        group = None
        try:
            group = self._group(leader, step_id, members, me)
            if robust != "none" and len(members) >= 3:
                gathered = [torch.empty_like(flat) for _ in members]
                group.allgather([gathered], [flat]).wait()
                segments = list(tensor_sizes) if tensor_sizes else [flat.numel()]
                reduced = robust_mean_by_segment(gathered, [max(weights[p], 1e-9) for p in members], segments, robust)
                flat.copy_(reduced.value)
            else:
                flat.mul_(weights[me] / total)
                group.allreduce([flat]).wait()
            return True
        except Exception as e:  # noqa: BLE001 - a failed collective fails the round, nothing more
            logger.warning(f"gloo round of {len(members)} replicas failed: {type(e).__name__}: {str(e)[:300]}")
            return False
        finally:
            if group is not None:
                try:
                    group.shutdown()
                except Exception:  # noqa: BLE001 - a group that failed may not shut down cleanly
                    pass

    def close(self) -> None:
        self.clients.clear()
