"""The peer's and the trainer's metrics: names, bounded labels, updates, and the HTTP endpoint."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest
import torch
from prometheus_client import Counter, Histogram

from peers.metrics import PeerMetrics
from process.config import ConfigError
from process.metrics_http import MetricsServerError, advertised_metrics_addr, serve_metrics, validate_metrics_options
from swarm.trainer.metrics import TrainerMetrics
from wire import compression

# Every label any swarm metric may carry: each takes a small, known set of values.
BOUNDED_LABELS = {
    "stage",
    "num_stages",
    "rpc",
    "kind",
    "codec",
    "result",
    "direction",
    "state",
    "version",
    "model",
    "mode",
}
# The one exception: the trainer's per-peer contribution gauges carry a shortened peer id, for at most
# EXPORTED_PEERS peers (test_peer_contribution_gauges_are_bounded_and_follow_the_ledger).
PEER_LABELLED = "swarm_trainer_peer_"


def sample(registry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


def swarm_collectors(metrics):
    return [c for c in metrics.registry._collector_to_names if getattr(c, "_name", "").startswith("swarm_")]


@pytest.mark.parametrize("make, prefix", [(PeerMetrics, "swarm_peer_"), (TrainerMetrics, "swarm_trainer_")])
def test_names_follow_the_convention_and_labels_are_bounded(make, prefix):
    metrics = make()
    collectors = swarm_collectors(metrics)
    assert len(collectors) >= 10
    for collector in collectors:
        name = collector._name
        assert name.startswith(prefix), name
        assert re.fullmatch(r"swarm_[a-z0-9_]+", name), name
        allowed = BOUNDED_LABELS | ({"peer"} if name.startswith(PEER_LABELLED) else set())
        assert set(collector._labelnames) <= allowed, (name, collector._labelnames)
        if not name.startswith(PEER_LABELLED):
            assert "peer" not in "".join(collector._labelnames)
        if isinstance(collector, Histogram):
            assert name.endswith("_seconds"), name
        if isinstance(collector, Counter):  # prometheus_client keeps a counter's name without _total
            assert not name.endswith("_total")
    for family in metrics.registry.collect():
        if family.name.startswith("swarm_"):
            for s in family.samples:
                allowed = BOUNDED_LABELS | ({"peer"} if s.name.startswith(PEER_LABELLED) else set())
                assert set(s.labels) - {"le"} <= allowed, (s.name, s.labels)


def test_peer_request_metrics_count_successes_failures_and_samples():
    m = PeerMetrics()
    m.observe_request(stage=1, rpc="forward", duration_s=0.02, samples=4, queue_s=0.001, compute_s=0.015)
    m.observe_request(stage=1, rpc="forward", duration_s=0.03, samples=4, queue_s=0.002, compute_s=0.02)
    m.observe_request(stage=1, rpc="backward", duration_s=0.5, failure_kind="internal")
    r = m.registry
    assert sample(r, "swarm_peer_requests_total", stage="1", rpc="forward") == 2
    assert sample(r, "swarm_peer_requests_total", stage="1", rpc="backward") == 1
    assert sample(r, "swarm_peer_samples_total", stage="1", rpc="forward") == 8
    assert sample(r, "swarm_peer_samples_total", stage="1", rpc="backward") is None
    assert sample(r, "swarm_peer_request_failures_total", stage="1", rpc="backward", kind="internal") == 1
    assert sample(r, "swarm_peer_request_duration_seconds_count", stage="1", rpc="forward") == 2
    assert sample(r, "swarm_peer_request_duration_seconds_sum", stage="1", rpc="forward") == pytest.approx(0.05)
    assert sample(r, "swarm_peer_request_duration_seconds_bucket", stage="1", rpc="forward", le="0.025") == 1
    assert sample(r, "swarm_peer_compute_duration_seconds_count", stage="1", rpc="backward") is None


def test_peer_stage_info_follows_a_move_and_state_is_one_hot():
    m = PeerMetrics()
    m.set_serving(stage=0, num_stages=2, version="1.0")
    m.set_serving(stage=1, num_stages=2, version="1.0")
    assert sample(m.registry, "swarm_peer_stage_info", stage="1", num_stages="2", version="1.0") == 1
    assert sample(m.registry, "swarm_peer_stage_info", stage="0", num_stages="2", version="1.0") is None
    m.set_state("online")
    states = {s: sample(m.registry, "swarm_peer_state", state=s) for s in ("joining", "online", "offline")}
    assert states == {"joining": 0, "online": 1, "offline": 0}


def test_peer_values_owned_elsewhere_are_read_at_scrape_time():
    m = PeerMetrics()
    state = {"in_flight": 0, "steps": 0}
    m.watch(
        in_flight=lambda: state["in_flight"],
        throughput=lambda: 123.5,
        runtime_counts=lambda: (state["steps"], 7, 2, 40, 1),
    )
    state.update(in_flight=3, steps=5)
    r = m.registry
    assert sample(r, "swarm_peer_requests_in_flight") == 3
    assert sample(r, "swarm_peer_throughput_samples_per_second") == 123.5
    assert sample(r, "swarm_peer_optimizer_steps_total") == 5
    assert sample(r, "swarm_peer_activation_cache_lookups_total", result="hit") == 7
    assert sample(r, "swarm_peer_activation_cache_lookups_total", result="miss") == 2
    assert sample(r, "swarm_peer_samples_accumulated_total") == 40
    assert sample(r, "swarm_peer_backward_repeats_total") == 1
    assert sample(r, "swarm_peer_device_memory_peak_bytes") == 0  # not given: a CPU peer's
    gpu = PeerMetrics()
    gpu.watch(
        in_flight=lambda: 0, throughput=lambda: 0.0, runtime_counts=lambda: (0,) * 5, device_memory_peak=lambda: 2.5e9
    )
    assert sample(gpu.registry, "swarm_peer_device_memory_peak_bytes") == 2.5e9


def test_bytes_by_codec_come_from_the_byte_counter():
    counter = compression.ByteCounter()
    m = PeerMetrics()
    m.count_bytes(counter.snapshot)
    tensor = torch.randn(64, 32)
    fp16 = compression.encode(tensor, "fp16")
    counter.record_sent(fp16)
    counter.record_sent(fp16)
    counter.record_received(compression.encode(tensor, "none"))
    r = m.registry
    assert sample(r, "swarm_peer_sent_bytes_total", codec="fp16") == 2 * fp16.nbytes == 2 * 64 * 32 * 2
    assert sample(r, "swarm_peer_sent_uncompressed_bytes_total", codec="fp16") == 2 * 64 * 32 * 4
    assert sample(r, "swarm_peer_received_bytes_total", codec="none") == 64 * 32 * 4
    assert sample(r, "swarm_peer_received_bytes_total", codec="fp16") is None


def test_trainer_metrics_show_every_stage_and_count_calls_failures_retries():
    m = TrainerMetrics()
    m.set_run(model="tiny", num_stages=3, codec="none", target_steps=10)
    r = m.registry
    assert [sample(r, "swarm_trainer_live_replicas", stage=str(s)) for s in range(3)] == [0, 0, 0]
    m.set_stages([2, 1, 0], [100.0, 50.0, 0.0])
    assert sample(r, "swarm_trainer_live_replicas", stage="0") == 2
    assert sample(r, "swarm_trainer_stage_throughput_samples_per_second", stage="1") == 50.0
    m.observe_call(stage=0, rpc="forward", duration_s=0.1)
    m.observe_failure(stage=0, rpc="forward", kind="timeout")
    assert sample(r, "swarm_trainer_calls_total", stage="0", rpc="forward") == 2
    assert sample(r, "swarm_trainer_call_failures_total", stage="0", rpc="forward", kind="timeout") == 1
    assert sample(r, "swarm_trainer_retries_total", stage="0") == 1
    assert sample(r, "swarm_trainer_calls_total", stage="2", rpc="backward") == 0
    m.observe_step(step=1, loss=5.5, tokens=128, duration_s=0.5)
    m.observe_step(step=2, loss=5.0, tokens=128, duration_s=0.25)
    assert sample(r, "swarm_trainer_step") == 2
    assert sample(r, "swarm_trainer_loss") == 5.0
    assert sample(r, "swarm_trainer_tokens_total") == 256
    assert sample(r, "swarm_trainer_tokens_per_second") == 512
    assert sample(r, "swarm_trainer_target_steps") == 10
    assert sample(r, "swarm_trainer_info", model="tiny", num_stages="3", codec="none") == 1


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "host, url_host",
    [
        ("127.0.0.1", "127.0.0.1"),
        pytest.param(
            "::1", "[::1]", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
        ),
    ],
)
def test_the_endpoint_serves_on_a_free_port_and_frees_it_on_close(host, url_host):
    m = PeerMetrics()
    m.observe_request(stage=0, rpc="forward", duration_s=0.01, samples=2)
    endpoint = serve_metrics(m.registry, host, 0)
    try:
        assert endpoint.port > 0 and endpoint.url == f"http://{url_host}:{endpoint.port}/metrics"
        text = urllib.request.urlopen(endpoint.url, timeout=5).read().decode()
        assert 'swarm_peer_requests_total{rpc="forward",stage="0"} 1.0' in text
        assert "_created" not in text
    finally:
        endpoint.close()
    with pytest.raises(OSError):  # nothing listens there any more
        urllib.request.urlopen(endpoint.url, timeout=5)


def test_the_endpoint_is_off_at_minus_one_and_a_taken_port_is_a_clear_error():
    assert serve_metrics(PeerMetrics().registry, "127.0.0.1", -1) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsServerError, match=f"cannot serve metrics on 127.0.0.1:{port}.*--metrics-port"):
            serve_metrics(PeerMetrics().registry, "127.0.0.1", port)


@pytest.mark.parametrize("host, port", [("127.0.0.1", 70000), ("127.0.0.1", -2), ("localhost", 0), ("", 0)])
def test_bad_metrics_options_are_config_errors(host, port):
    with pytest.raises(ConfigError):
        validate_metrics_options(host, port)


def test_the_advertised_address_is_one_others_can_dial():
    assert advertised_metrics_addr("127.0.0.1", 9100) == "127.0.0.1:9100"
    assert advertised_metrics_addr("::1", 9100) == "[::1]:9100"
    assert (
        advertised_metrics_addr(
            "0.0.0.0", 9100, announce_maddrs=["/ip4/203.0.113.5/tcp/31337"], host_maddrs=["/ip4/0.0.0.0/tcp/0"]
        )
        == "203.0.113.5:9100"
    )
    assert (
        advertised_metrics_addr("0.0.0.0", 9100, host_maddrs=["/ip4/0.0.0.0/tcp/0", "/ip4/10.1.2.3/tcp/5"])
        == "10.1.2.3:9100"
    )
    assert (
        advertised_metrics_addr(
            "0.0.0.0", 9100, announce_maddrs=["/dns4/example.org/tcp/1"], host_maddrs=["/ip4/0.0.0.0/tcp/0"]
        )
        is None
    )


def _counts(stage: int, samples: int, banned: str | None = None) -> dict:
    return {
        "stage": stage,
        "samples_served": samples,
        "calls_answered": samples // 2,
        "calls_failed": 1,
        "calls_verified": 2,
        "mismatches": 1 if banned else 0,
        "samples_verified": 0 if banned else samples // 4,
        "disputes": 0,
        "banned": banned,
    }


def test_peer_contribution_gauges_are_bounded_and_follow_the_ledger():
    from swarm.trainer.metrics import EXPORTED_PEERS

    m = TrainerMetrics()
    r = m.registry
    many = {f"QmPeer{i:04d}xxxxxxxxABCD{i:04d}": _counts(i % 2, samples=10 + i) for i in range(EXPORTED_PEERS + 8)}
    many["QmLiar000000000LIAR0001"] = _counts(0, samples=0, banned="stage 0: differed")
    m.set_contributions(many)
    exported = {
        s.labels["peer"] for s in next(f for f in r.collect() if f.name == "swarm_trainer_peer_calls_failed").samples
    }
    assert len(exported) == EXPORTED_PEERS
    assert "IAR0001" in {p[-7:] for p in exported}  # the banned peer shows first though it served nothing
    assert sample(r, "swarm_trainer_peer_banned", peer="LIAR0001", stage="0") == 1
    top = f"QmPeer{EXPORTED_PEERS + 7:04d}xxxxxxxxABCD{EXPORTED_PEERS + 7:04d}"
    top_stage = str((EXPORTED_PEERS + 7) % 2)
    assert sample(r, "swarm_trainer_peer_samples_served", peer=top[-8:], stage=top_stage) == EXPORTED_PEERS + 17
    assert sample(r, "swarm_trainer_peer_banned", peer=top[-8:], stage=top_stage) == 0
    assert (
        sample(r, "swarm_trainer_peer_samples_verified", peer=top[-8:], stage=top_stage) == (EXPORTED_PEERS + 17) // 4
    )
    assert sample(r, "swarm_trainer_peer_samples_served", peer="ABCD0000", stage="0") is None  # served least

    m.set_contributions({top: _counts(1 - int(top_stage), samples=5)})  # moved stage; the rest gone
    assert sample(r, "swarm_trainer_peer_samples_served", peer=top[-8:], stage=top_stage) is None
    assert sample(r, "swarm_trainer_peer_samples_served", peer=top[-8:], stage=str(1 - int(top_stage))) == 5
    assert sample(r, "swarm_trainer_peer_banned", peer="LIAR0001", stage="0") is None
