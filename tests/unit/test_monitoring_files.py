"""monitoring/: the dashboard is generated from its script, and every metric that the dashboard and
the alert rules name is one the code exports (read from the metrics modules' registries)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from peers.compute.utilization import ComputeClock
from peers.metrics import PeerMetrics
from swarm.trainer.metrics import TrainerMetrics
from wire.compression import ByteCounter

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
BUILTIN_SERIES = {"up"}  # written by Prometheus itself for every target


def exported_series_names() -> set[str]:
    """Every series name the peer and the trainer can expose, by metric type."""
    peer, trainer = PeerMetrics(), TrainerMetrics()
    peer.watch(in_flight=lambda: 0, throughput=lambda: 0.0, runtime_counts=lambda: (0, 0, 0, 0, 0))
    peer.watch_compute(ComputeClock(), dict)
    peer.count_bytes(ByteCounter().snapshot)
    trainer.watch_phases(dict)
    trainer.count_bytes(ByteCounter().snapshot)
    names = set()
    for registry in (peer.registry, trainer.registry):
        for family in registry.collect():
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["_sum", "_count", ""],
            }.get(family.type, [""])
            names |= {family.name + suffix for suffix in suffixes}
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names in by/on/... lists, label matchers, strings or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group(0) in PROMQL_WORDS:
            continue  # a function call or a keyword
        names.add(match.group(0))
    return names


def dashboard() -> dict:
    return json.loads((MONITORING / "grafana" / "dashboards" / "swarm.json").read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def test_the_metric_name_reader_skips_functions_labels_and_durations():
    expr = (
        "histogram_quantile(0.9, sum by (le, stage) (rate(swarm_peer_request_duration_seconds_bucket"
        '{job="swarm-peer", stage=~"1|2"}[$__rate_interval]))) / on (instance) group_left (stage) '
        "swarm_peer_stage_info and time() - process_start_time_seconds > 600 unless up == 0"
    )
    assert metric_names(expr) == {
        "swarm_peer_request_duration_seconds_bucket",
        "swarm_peer_stage_info",
        "process_start_time_seconds",
        "up",
    }


@pytest.mark.parametrize("source, exprs", [("dashboard", dashboard_exprs), ("alert rules", alert_exprs)])
def test_every_metric_named_is_one_the_code_exports(source, exprs):
    exported = exported_series_names() | BUILTIN_SERIES
    all_exprs = exprs()
    assert len(all_exprs) >= 5
    for expr in all_exprs:
        names = metric_names(expr)
        assert names, f"{source}: no metric in {expr!r}"
        assert names <= exported, f"{source}: {sorted(names - exported)} not exported by the code ({expr!r})"


def test_a_renamed_metric_would_be_caught():
    exported = exported_series_names()
    assert "swarm_peer_requests_total" in exported and "swarm_trainer_call_duration_seconds_bucket" in exported
    assert not metric_names("rate(swarm_peer_request_total[5m])") <= exported


def test_the_dashboard_shows_what_the_issue_asks_for():
    named = set().union(*(metric_names(e) for e in dashboard_exprs()))
    for metric in [
        "swarm_peer_stage_info",
        "swarm_trainer_live_replicas",  # stages and replicas
        "swarm_peer_samples_total",  # throughput per stage
        "swarm_peer_sent_bytes_total",
        "swarm_trainer_sent_bytes_total",  # bytes per codec
        "swarm_trainer_call_failures_total",
        "swarm_peer_request_failures_total",  # failures
        "swarm_trainer_loss",
        "swarm_trainer_tokens_total",  # loss, tokens/s
        "swarm_peer_averaging_rounds_total",
        "swarm_peer_rebalance_moves_total",
        "swarm_trainer_peer_samples_served",  # contributions per peer (issue #25)
        "swarm_trainer_peer_calls_failed",
        "swarm_trainer_peer_mismatches",
        "swarm_trainer_peer_banned",
        "swarm_trainer_calls_verified_total",
        "swarm_peer_compute_busy_seconds_total",  # compute utilisation (issue #55)
        "swarm_peer_phase_seconds_total",
    ]:
        assert metric in named, metric


def test_the_dashboard_is_well_formed_and_generated_from_its_script():
    spec = importlib.util.spec_from_file_location("build_dashboard", MONITORING / "grafana" / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (MONITORING / "grafana" / "dashboards" / "swarm.json").read_text() == module.render(), (
        "run `python monitoring/grafana/build_dashboard.py` after editing it"
    )
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    provisioned = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "datasources" / "swarm.yml").read_text())
    assert variables["datasource"]["current"]["value"] == provisioned["datasources"][0]["uid"]


def test_prometheus_scrapes_the_file_the_monitor_writes():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["swarm-peer"]["file_sd_configs"][0]["files"] == ["targets/*.json"]
    assert config["rule_files"] == ["alerts.yml"]
    assert (MONITORING / "targets").is_dir()
