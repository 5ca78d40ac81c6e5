"""Averaging traffic accounting and its metrics (pure parts of peers/averaging.py, no network)."""

from __future__ import annotations

import pytest
import torch

from peers.averaging import COMPRESSIONS, AveragingRound, allreduce_bytes_each_way, wire_bytes_per_value
from peers.metrics import PeerMetrics


def test_a_replica_alone_moves_nothing_and_a_pair_moves_its_whole_tensor_each_way():
    assert allreduce_bytes_each_way(1000, 1, 4.0) == 0
    # two replicas: half of our tensor goes out and comes back averaged, the other's copy of our
    # half comes in and goes back as a difference: 1000 values out and 1000 in
    assert allreduce_bytes_each_way(1000, 2, 4.0) == 4000
    assert allreduce_bytes_each_way(1000, 4, 2.0) == 3000  # 2 * 3/4 * 1000 values at 2 bytes


@pytest.mark.parametrize("codec, low, high", [("none", 4.0, 4.01), ("fp16", 2.0, 2.01), ("int8", 1.0, 1.05)])
def test_the_codecs_serialized_size_per_value_is_measured(codec, low, high):
    tensors = [torch.randn(256, 256), torch.randn(1024)]
    assert low <= wire_bytes_per_value(COMPRESSIONS[codec](), tensors) <= high


def test_averaging_rounds_and_bytes_are_counted_per_mode():
    m = PeerMetrics()
    m.set_averaging_mode("periodic")
    r = m.registry
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "periodic", "result": "ok"}) == 0
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "sync", "result": "ok"}) is None
    m.observe_averaging_round(AveragingRound("periodic", ok=True, group_size=2, sent_bytes=400, received_bytes=400))
    m.observe_averaging_round(AveragingRound("periodic", ok=True, group_size=3, sent_bytes=500, received_bytes=500))
    m.observe_averaging_round(AveragingRound("periodic", ok=False, group_size=0, sent_bytes=0, received_bytes=0))
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "periodic", "result": "ok"}) == 2
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "periodic", "result": "failed"}) == 1
    for direction in ("sent", "received"):
        assert r.get_sample_value("swarm_peer_averaging_bytes_total", {"mode": "periodic", "direction": direction}) == 900
    assert r.get_sample_value("swarm_peer_averaging_group_size", {"mode": "periodic"}) == 3


def test_a_peer_without_averaging_shows_no_averaging_series():
    m = PeerMetrics()
    m.set_averaging_mode("none")
    samples = [s for f in m.registry.collect() if f.name.startswith("swarm_peer_averaging") for s in f.samples]
    assert samples == []
