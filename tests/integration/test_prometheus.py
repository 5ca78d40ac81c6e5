"""monitoring/ checked by Prometheus' own tools, and a real Prometheus scraping a live loopback
swarm: peers found through the DHT by `swarm monitor targets`, the trainer by its address.

Needs Debian's `prometheus` package (`prometheus` and `promtool`); the tests skip without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from process.metrics_http import free_port
from tests.integration.polling import wait_for

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install -y prometheus)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus server is not installed (apt-get install -y prometheus)"
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_accepts_the_config_and_the_rules():
    for args in (
        ["check", "config", str(MONITORING / "prometheus.yml")],
        ["check", "rules", str(MONITORING / "alerts.yml")],
        ["test", "rules", str(MONITORING / "alerts_test.yml")],
    ):
        result = promtool(*args)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        assert "SUCCESS" in result.stdout + result.stderr


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path):
    board = json.loads((MONITORING / "grafana" / "dashboards" / "swarm.json").read_text())
    exprs = [t["expr"].replace("$__rate_interval", "1m") for p in board["panels"] for t in p.get("targets", [])]
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def api(base: str, path: str, **params):
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, expr: str) -> list[dict]:
    try:
        return api(base, "/api/v1/query", query=expr)["result"]
    except OSError:  # not listening yet
        return []


@pytest.fixture
def run_prometheus(tmp_path):
    """Factory: run_prometheus(config_dict) -> base URL; the server is killed after the test."""
    started: list[subprocess.Popen] = []

    def start(config: dict) -> str:
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "w")
        popen = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        started.append(popen)
        return f"http://127.0.0.1:{port}"

    yield start
    for popen in started:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGTERM)
            try:
                popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(timeout=5)


@pytest.mark.slow
@needs_prometheus
def test_prometheus_scrapes_a_live_swarm(make_swarm, run_prometheus, tmp_path):
    swarm = make_swarm(num_stages=2, peer_args=["--target-batch-size", "8"])
    swarm.start_bootstrap()
    peers = [swarm.start_peer(0), swarm.start_peer(1)]
    swarm.wait_online(peers)

    # peers are found through the DHT: the monitor writes the file_sd file Prometheus reads
    targets_dir = tmp_path / "targets"
    targets_dir.mkdir()
    monitor = swarm.start_monitor("--out", str(targets_dir / "peers.json"), "--period-s", "1")
    wait_for(
        lambda: (
            (targets_dir / "peers.json").exists()
            and sum(len(g["targets"]) for g in json.loads((targets_dir / "peers.json").read_text())) == 2
        ),
        60,
        f"two targets in the file_sd file\n{monitor.log()}",
    )

    trainer = swarm.start_trainer(
        "--steps",
        "100000",
        "--batch-size",
        "4",
        "--microbatch-size",
        "2",
        "--max-in-flight",
        "1",
        "--num-stages",
        "2",
        "--metrics-port",
        "0",
    )
    trainer_addr = wait_for(
        lambda: re.search(r"metrics on http://(\S+)/metrics", trainer.log()), 60, "the trainer's metrics address"
    ).group(1)

    # the shipped configuration, with the test's paths, the trainer's address and 1 s intervals
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["swarm-peer"]["file_sd_configs"][0]["files"] = [str(targets_dir / "*.json")]
    jobs["swarm-trainer"]["static_configs"] = [{"targets": [trainer_addr]}]
    shutil.copy(MONITORING / "alerts.yml", tmp_path / "alerts.yml")
    base = run_prometheus(config)

    def log_tail() -> str:
        return (tmp_path / "prometheus.log").read_text()[-2000:]

    by_stage = wait_for(
        lambda: (
            {
                r["metric"].get("stage"): r
                for r in query(base, "swarm_peer_requests_total > 0")
                if r["metric"]["rpc"] in ("backward", "train_chain")  # hub routing's calls, or direct's
            }.keys()
            >= {"0", "1"}
            and query(base, "swarm_peer_requests_total > 0")
        ),
        90,
        f"requests counted by both peers to be scraped\n{log_tail()}",
    )
    peer_series = by_stage[0]["metric"]
    assert peer_series["job"] == "swarm-peer" and peer_series["swarm_model"] == "tiny"  # labels from file_sd
    assert peer_series["swarm_stage"] == peer_series["stage"]

    step = wait_for(
        lambda: query(base, 'swarm_trainer_step{job="swarm-trainer"} > 0'),
        60,
        f"the trainer's step to be scraped\n{trainer.log()[-2000:]}\n{log_tail()}",
    )
    assert float(step[0]["value"][1]) >= 1
    replicas = {r["metric"]["stage"]: float(r["value"][1]) for r in query(base, "swarm_trainer_live_replicas")}
    assert replicas == {"0": 1.0, "1": 1.0}

    active = api(base, "/api/v1/targets")["activeTargets"]
    assert sorted(t["labels"]["job"] for t in active) == ["swarm-peer", "swarm-peer", "swarm-trainer"]
    wait_for(
        lambda: all(t["health"] == "up" for t in api(base, "/api/v1/targets")["activeTargets"]),
        30,
        "every target to be up",
    )

    def evaluated_rules():
        rules = [r for g in api(base, "/api/v1/rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_for(evaluated_rules, 30, "the alert rules to be evaluated")
    assert len(rules) == 6 and all(r["health"] == "ok" for r in rules), rules
    firing = [r["name"] for r in rules if r["state"] != "inactive"]
    assert firing == [], f"alerts fire on a healthy swarm: {firing}"
