"""A planner topology from the links peers measured and published (dht/link_records.py). Pure.

Devices are the peers that published a link record, numbered in sorted peer-id order. A pair
measured in both directions gets the mean of both (the paper's symmetrisation, done by
`topology_from_dict`); a pair measured one way uses that measurement both ways; a pair measured by
neither side is estimated conservatively: the worst latency and the lowest bandwidth measured
anywhere in the swarm. Such pairs are reported, so a user can tell a plan made from measurements
from one made on guesses. Latency in the topology is one way: half the measured round trip.

If the peers do not divide evenly into the stages, the ones with the worst links (highest mean
pipeline cost to every other peer) are left out as spares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dht.link_records import LinkRecord
from dht.records import PeerRecord, PeerState
from swarm.planner.cost import BITS_PER_BYTE
from swarm.planner.topology import Topology, TopologyError, topology_from_dict

__all__ = ["LiveTopology", "departed_peers", "topology_from_link_records"]


def departed_peers(link_peers: Sequence[str], stage_records: Sequence[PeerRecord]) -> dict[str, str]:
    """The peers of `link_peers` that must not be planned for, with why: those whose newest stage
    record says `offline`, and those with no unexpired stage record at all (gone without a word; a
    link record outlives its peer by up to its TTL)."""
    newest: dict[str, PeerRecord] = {}
    for record in stage_records:
        if record.peer_id not in newest or record.expires_at > newest[record.peer_id].expires_at:
            newest[record.peer_id] = record
    departed = {}
    for peer_id in link_peers:
        record = newest.get(peer_id)
        if record is None:
            departed[peer_id] = "no stage record: gone"
        elif record.state == PeerState.OFFLINE:
            departed[peer_id] = "announced offline"
    return departed


@dataclass(frozen=True, eq=False)
class LiveTopology:
    """A topology whose device ``i`` is the peer ``peer_ids[i]``.

    Attributes:
        topology: the validated, symmetrised network of the planned peers.
        peer_ids: the planned peers, device order.
        spares: peers left out so the rest divide evenly into the stages.
        measured_pairs: unordered pairs with a measurement in at least one direction.
        one_way_pairs: of those, pairs measured in one direction only.
        estimated_pairs: unordered pairs nobody measured (estimated conservatively), as peer ids.
        stale_links: measurements ignored for being older than the age limit.
    """

    topology: Topology
    peer_ids: tuple[str, ...]
    spares: tuple[str, ...]
    measured_pairs: int
    one_way_pairs: int
    estimated_pairs: tuple[tuple[str, str], ...]
    stale_links: int

    def describe(self) -> str:
        """One line on how much of the topology was measured."""
        total = len(self.peer_ids) * (len(self.peer_ids) - 1) // 2
        text = (
            f"{len(self.peer_ids)} peers, {self.measured_pairs} of {total} pairs measured "
            f"({self.one_way_pairs} one way only), {len(self.estimated_pairs)} estimated"
        )
        if self.stale_links:
            text += f", {self.stale_links} stale measurements ignored"
        if self.spares:
            text += f"; left out as spares: {', '.join(p[-8:] for p in self.spares)}"
        return text


def _directed_matrices(
    records: Sequence[LinkRecord], peers: list[str], now: float, max_link_age_s: float | None
) -> tuple[np.ndarray, np.ndarray, int]:
    """(N, N) one-way latency in ms and bandwidth in Gbit/s as measured from row to column; NaN
    where unmeasured. Also the number of stale measurements skipped."""
    index = {peer: i for i, peer in enumerate(peers)}
    count = len(peers)
    latency_ms = np.full((count, count), np.nan)
    bandwidth = np.full((count, count), np.nan)
    stale = 0
    for record in records:
        source = index.get(record.peer_id)
        if source is None:
            continue
        for target, link in record.links.items():
            if target not in index:
                continue  # a peer that published no record: not a device of this plan
            if max_link_age_s is not None and now - link.measured_at > max_link_age_s:
                stale += 1
                continue
            latency_ms[source, index[target]] = link.rtt_ms / 2.0
            bandwidth[source, index[target]] = link.bandwidth_gbps
    return latency_ms, bandwidth, stale


def topology_from_link_records(
    records: Sequence[LinkRecord],
    *,
    stages: int,
    c_dp_gb: float,
    c_pp_gb: float,
    now: float,
    max_link_age_s: float | None = None,
    name: str = "",
) -> LiveTopology:
    """Build the topology for ``stages`` pipeline stages from the peers' link records.

    Args:
        records: one record per peer (duplicates by peer id: the most recent counts).
        stages: pipeline stages D_PP; the replicas D_DP are the peers per stage that fit.
        c_dp_gb, c_pp_gb: the cost model's transfer sizes (see topology.py).
        now: DHT time, to judge the age of measurements.
        max_link_age_s: ignore measurements older than this (None: use all).
        name: a label for reports.

    Raises:
        TopologyError: fewer peers than stages, or no link measured at all between the peers.
    """
    if stages < 1:
        raise TopologyError(f"stages must be at least 1, got {stages}")
    newest: dict[str, LinkRecord] = {}
    for record in records:
        if record.peer_id not in newest or record.measured_at > newest[record.peer_id].measured_at:
            newest[record.peer_id] = record
    peers = sorted(newest)
    if len(peers) < stages:
        raise TopologyError(
            f"only {len(peers)} peer(s) published link records; a plan for {stages} stages needs at least {stages}"
        )
    ordered = [newest[p] for p in peers]
    latency_ms, bandwidth, stale = _directed_matrices(ordered, peers, now, max_link_age_s)
    count = len(peers)
    off_diagonal = ~np.eye(count, dtype=bool)
    measured = ~np.isnan(latency_ms)  # (N, N) directed
    either = (measured | measured.T) & off_diagonal
    both = measured & measured.T & off_diagonal
    if count > 1 and not either.any():
        raise TopologyError(
            f"none of the {count} peers has measured a link to another yet; wait for a "
            f"probe round (a peer's --link-probe-period-s) and try again"
        )
    # One-way pairs: copy the measured direction onto the other.
    latency_ms = np.where(measured, latency_ms, latency_ms.T)
    bandwidth = np.where(measured, bandwidth, bandwidth.T)
    # Unmeasured pairs: the worst seen anywhere.
    missing = np.isnan(latency_ms) & off_diagonal
    if missing.any():
        latency_ms[missing] = np.nanmax(latency_ms[either])
        bandwidth[missing] = np.nanmin(bandwidth[either])
    np.fill_diagonal(latency_ms, 0.0)
    np.fill_diagonal(bandwidth, 1.0)  # unused: a device never talks to itself
    estimated = [(peers[i], peers[j]) for i, j in zip(*np.nonzero(np.triu(missing)))]

    replicas = count // stages
    keep = _keep_best_connected(
        latency_ms, bandwidth, [newest[p].throughput for p in peers], peers, stages * replicas, c_pp_gb
    )
    kept = [peers[i] for i in keep]
    spares = tuple(p for p in peers if p not in set(kept))
    topology = topology_from_dict(
        {
            "name": name,
            "stages": stages,
            "replicas": replicas,
            "c_dp_gb": c_dp_gb,
            "c_pp_gb": c_pp_gb,
            "latency_ms": latency_ms[np.ix_(keep, keep)].tolist(),
            "bandwidth_gbps": bandwidth[np.ix_(keep, keep)].tolist(),
        }
    )
    kept_set = set(kept)
    return LiveTopology(
        topology=topology,
        peer_ids=tuple(kept),
        spares=spares,
        measured_pairs=int(np.triu(either).sum()),
        one_way_pairs=int(np.triu(either & ~both).sum()),
        estimated_pairs=tuple(pair for pair in estimated if pair[0] in kept_set and pair[1] in kept_set),
        stale_links=stale,
    )


def _keep_best_connected(
    latency_ms: np.ndarray, bandwidth: np.ndarray, throughput: list[float], peers: list[str], keep: int, c_pp_gb: float
) -> list[int]:
    """Indices (ascending) of the ``keep`` peers with the lowest mean pipeline cost to the others;
    ties go to the higher throughput, then the smaller peer id."""
    count = len(peers)
    if keep >= count:
        return list(range(count))
    symmetric_latency_s = (latency_ms + latency_ms.T) / 2.0 / 1e3  # (N, N)
    symmetric_bandwidth = (bandwidth + bandwidth.T) / 2.0  # (N, N)
    pipeline_s = 2.0 * (symmetric_latency_s + c_pp_gb * BITS_PER_BYTE / symmetric_bandwidth)  # (N, N)
    np.fill_diagonal(pipeline_s, 0.0)
    mean_cost = pipeline_s.sum(axis=1) / max(count - 1, 1)  # (N,)
    order = sorted(range(count), key=lambda i: (round(float(mean_cost[i]), 9), -throughput[i], peers[i]))
    return sorted(order[:keep])
