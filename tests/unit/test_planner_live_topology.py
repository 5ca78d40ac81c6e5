"""The live planner's topology, built from the links peers measured (pure; no network)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dht.link_records import LinkMeasurement, LinkRecord
from models.config import get_model_config
from models.stages import build_stage, equal_boundaries
from swarm.planner.live_topology import topology_from_link_records
from swarm.planner.search import search_plan
from swarm.planner.topology import TopologyError
from swarm.planner.workload import estimated_communication_sizes

NOW = 1000.0


def record(
    peer: str,
    links: dict[str, tuple[float, float]],
    *,
    throughput: float = 10.0,
    measured_at: float = NOW,
    stage: int | None = 0,
) -> LinkRecord:
    """links: {target: (rtt_ms, bandwidth_gbps)}."""
    return LinkRecord(
        peer_id=peer,
        model="tiny",
        stage=stage,
        num_stages=2,
        throughput=throughput,
        measured_at=measured_at,
        expires_at=measured_at + 60.0,
        links={
            target: LinkMeasurement(rtt_ms=rtt, bandwidth_gbps=bw, measured_at=measured_at)
            for target, (rtt, bw) in links.items()
        },
    )


def build(records, stages=2, **kwargs):
    return topology_from_link_records(records, stages=stages, c_dp_gb=0.1, c_pp_gb=0.05, now=NOW, **kwargs)


def full_mesh(peers: list[str], rtt, bw) -> list[LinkRecord]:
    """Every peer measured every other: rtt(a, b) ms, bw(a, b) Gbit/s."""
    return [record(a, {b: (rtt(a, b), bw(a, b)) for b in peers if b != a}) for a in peers]


def test_devices_are_peers_in_id_order_and_both_directions_are_averaged() -> None:
    records = [record("B", {"A": (4.0, 2.0)}), record("A", {"B": (2.0, 1.0)})]
    live = build(records, stages=1)
    assert live.peer_ids == ("A", "B")
    # One-way latency is half the round trip; the two directions are averaged.
    assert live.topology.latency_s[0, 1] == pytest.approx((1.0 + 2.0) / 2 / 1e3)
    assert live.topology.bandwidth_gbps[0, 1] == pytest.approx(1.5)
    assert (live.measured_pairs, live.one_way_pairs, live.estimated_pairs) == (1, 0, ())


def test_a_pair_measured_one_way_uses_that_measurement_both_ways() -> None:
    live = build([record("A", {"B": (10.0, 0.5)}), record("B", {})], stages=1)
    assert live.topology.latency_s[1, 0] == pytest.approx(5.0 / 1e3)
    assert live.topology.bandwidth_gbps[1, 0] == pytest.approx(0.5)
    assert (live.measured_pairs, live.one_way_pairs) == (1, 1)


def test_unmeasured_pairs_get_the_worst_link_seen_and_are_reported() -> None:
    records = [
        record("A", {"B": (2.0, 1.0), "C": (40.0, 0.1)}),
        record("B", {}),
        record("C", {}),
        record("D", {"A": (6.0, 0.8)}),
    ]
    live = build(records)
    index = {p: i for i, p in enumerate(live.peer_ids)}
    estimated = {frozenset(pair) for pair in live.estimated_pairs}
    assert estimated == {frozenset("BC"), frozenset("BD"), frozenset("CD")}
    for a, b in ("BC", "BD", "CD"):
        assert live.topology.latency_s[index[a], index[b]] == pytest.approx(20.0 / 1e3)  # worst: 40 ms round trip
        assert live.topology.bandwidth_gbps[index[a], index[b]] == pytest.approx(0.1)  # lowest bandwidth seen
    assert "3 estimated" in live.describe()


def test_links_to_peers_without_a_record_and_stale_links_are_ignored() -> None:
    records = [
        record("A", {"B": (2.0, 1.0), "GONE": (1.0, 9.0)}),
        record("B", {"A": (100.0, 0.01)}, measured_at=NOW - 500.0),
    ]
    live = build(records, stages=1, max_link_age_s=300.0)
    assert live.peer_ids == ("A", "B")
    assert live.stale_links == 1
    assert live.topology.bandwidth_gbps[0, 1] == pytest.approx(1.0)  # only A's fresh measurement counts


def test_the_newest_record_of_a_peer_counts() -> None:
    old = record("A", {"B": (50.0, 0.01)}, measured_at=NOW - 10)
    new = record("A", {"B": (2.0, 1.0)})
    live = build([new, old, record("B", {})], stages=1)
    assert live.topology.bandwidth_gbps[0, 1] == pytest.approx(1.0)


def test_the_worst_connected_peers_are_left_out_as_spares() -> None:
    peers = ["A", "B", "C", "D", "E"]

    def rtt(a, b):
        return 80.0 if "C" in (a, b) else 2.0

    live = build(full_mesh(peers, rtt, lambda a, b: 1.0))
    assert live.spares == ("C",)
    assert live.peer_ids == ("A", "B", "D", "E")
    assert live.topology.replicas == 2 and live.topology.num_devices == 4
    assert "spares" in live.describe()


def test_too_few_peers_or_no_measurement_is_a_clear_error() -> None:
    with pytest.raises(TopologyError, match="only 1 peer"):
        build([record("A", {})], stages=2)
    with pytest.raises(TopologyError, match="none of the 2 peers has measured"):
        build([record("A", {}), record("B", {})], stages=2)


def test_plan_finds_the_fast_pairs_and_does_not_depend_on_record_order() -> None:
    """Two sites {A, B, C} and {D, E, F}: fast inside (1 ms, 10 Gbit/s), slow across (100 ms, 0.1
    Gbit/s). Activations dominate (c_pp 0.5 GB: 40 s across, 0.4 s inside; c_dp 0.01 GB), so the
    best plan keeps each pipeline inside one site: every stage has one replica in each site. The
    plan must not change when the records arrive in another order."""
    peers = ["A", "B", "C", "D", "E", "F"]

    def same_site(a, b):
        return (a in "ABC") == (b in "ABC")

    records = full_mesh(
        peers, lambda a, b: 2.0 if same_site(a, b) else 200.0, lambda a, b: 10.0 if same_site(a, b) else 0.1
    )
    plans = []
    for seed in range(3):
        shuffled = list(records)
        random.Random(seed).shuffle(shuffled)
        live = topology_from_link_records(shuffled, stages=3, c_dp_gb=0.01, c_pp_gb=0.5, now=NOW)
        result = search_plan(live.topology, seed=0, time_limit_s=10, max_rounds=4)
        plans.append(([[live.peer_ids[d] for d in group] for group in result.groups], result.cost.total_s))
    assert all(plan == plans[0] for plan in plans)
    groups, _ = plans[0]
    assert all(not same_site(*group) for group in groups)


def test_estimated_sizes_match_the_stages_the_peers_build() -> None:
    config = get_model_config("tiny")
    boundaries = equal_boundaries(config.n_layers, 2)
    sizes = estimated_communication_sizes(config, boundaries, samples_per_macro_batch=8)
    for stage, c_dp in enumerate(sizes.c_dp_gb):
        parameters = sum(p.numel() for p in build_stage(config, stage, 2).parameters())
        assert c_dp * 1e9 == pytest.approx(parameters * 4)
    module = build_stage(config, 0, 2)
    activation = module(torch.zeros(8, config.seq_len, dtype=torch.long))
    assert sizes.c_pp_gb == pytest.approx((activation.numel() * 4 / 1e9,))
    assert np.isfinite(sizes.c_pp_gb).all()


def _stage_record(peer_id: str, state: str, expires_at: float):
    from dht.records import PeerRecord, PeerState

    return PeerRecord(
        peer_id=peer_id,
        model="tiny",
        stage=0,
        num_stages=2,
        state=PeerState(state),
        throughput=1.0,
        load=0.0,
        version="dev",
        expires_at=expires_at,
    )


def test_peers_that_announced_offline_or_are_gone_are_not_planned_for():
    from swarm.planner.live_topology import departed_peers

    records = [
        _stage_record("online", "online", 100.0),
        _stage_record("left", "online", 100.0),
        _stage_record("left", "offline", 110.0),  # its newest record says it left
        _stage_record("back", "offline", 100.0),
        _stage_record("back", "online", 120.0),  # ...and this one came back
    ]
    departed = departed_peers(["online", "left", "back", "vanished"], records)
    assert departed == {"left": "announced offline", "vanished": "no stage record: gone"}
