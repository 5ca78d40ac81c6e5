"""Writes dashboards/swarm.json, the "Swarm overview" Grafana dashboard. Edit the panels here and
run `python monitoring/grafana/build_dashboard.py`; a unit test checks the JSON is up to date and
that every metric its queries name is one the code exports."""

from __future__ import annotations

import json
import os

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
WIDTH = 24  # Grafana's grid width


def target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False, table: bool = False) -> dict:
    t = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"], t["range"] = True, False
    if table:
        t["format"] = "table"
    return t


def panel(
    title: str,
    kind: str,
    targets: list[dict],
    *,
    description: str = "",
    unit: str = "short",
    w: int = 12,
    h: int = 8,
    options: dict | None = None,
    transformations: list | None = None,
) -> dict:
    refs = "ABCDEFGH"
    return {
        "title": title,
        "type": kind,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [{**t, "refId": refs[i]} for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": options or {},
        "transformations": transformations or [],
        "gridPos": {"w": w, "h": h},
    }


def row(title: str) -> dict:
    return {"title": title, "type": "row", "collapsed": False, "panels": [], "gridPos": {"w": WIDTH, "h": 1}}


PANELS = [
    row("Swarm"),
    panel(
        "Online peers per stage",
        "bargauge",
        [target("count by (stage) (swarm_peer_stage_info)", "stage {{stage}}", instant=True)],
        description="Peers scraped now, by the stage they serve (swarm_peer_stage_info). A thin stage is "
        "the pipeline's bottleneck.",
        w=6,
    ),
    panel(
        "Training progress",
        "stat",
        [
            target("max(swarm_trainer_step)", "step", instant=True),
            target("max(swarm_trainer_target_steps)", "of", instant=True),
            target("max(swarm_trainer_loss)", "loss", instant=True),
        ],
        description="Steps done, steps planned and the last step's loss.",
        w=6,
    ),
    panel(
        "Live replicas per stage (trainer's view)",
        "timeseries",
        [target("swarm_trainer_live_replicas", "stage {{stage}}")],
        description="Online replicas of each stage in the DHT as the trainer last read them; 0 blocks training.",
        w=12,
    ),
    panel(
        "Peers",
        "table",
        [
            target("swarm_peer_stage_info", "", instant=True, table=True),
            target("swarm_peer_throughput_samples_per_second", "", instant=True, table=True),
            target("swarm_peer_requests_in_flight", "", instant=True, table=True),
        ],
        description="Every scraped peer: stage, version, announced throughput (samples/s), requests in flight.",
        w=24,
        h=8,
        options={"showHeader": True},
        transformations=[
            {"id": "merge", "options": {}},  # one row per peer (instance)
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "__name__": True, "Value #A": True},
                    "renameByName": {"Value #B": "samples/s", "Value #C": "in flight"},
                },
            },
        ],
    ),
    row("Training"),
    panel(
        "Loss",
        "timeseries",
        [target("swarm_trainer_loss", "{{instance}}")],
        description="Mean cross-entropy (nats) of each step.",
        w=8,
    ),
    panel(
        "Tokens/s",
        "timeseries",
        [target(f"sum(rate(swarm_trainer_tokens_total[{RATE}]))", "tokens/s")],
        unit="short",
        w=8,
    ),
    panel(
        "Step time",
        "timeseries",
        [
            target(
                f"histogram_quantile(0.5, sum by (le) (rate(swarm_trainer_step_duration_seconds_bucket[{RATE}])))",
                "p50",
            ),
            target(
                f"histogram_quantile(0.9, sum by (le) (rate(swarm_trainer_step_duration_seconds_bucket[{RATE}])))",
                "p90",
            ),
        ],
        unit="s",
        w=8,
    ),
    row("Stages"),
    panel(
        "Throughput per stage",
        "timeseries",
        [
            target(f"sum by (stage) (rate(swarm_peer_samples_total[{RATE}]))", "stage {{stage}} computed"),
            target(
                "sum by (stage) (swarm_peer_throughput_samples_per_second * on (instance, job) group_left (stage) "
                "swarm_peer_stage_info)",
                "stage {{stage}} capacity",
            ),
        ],
        description="Samples/s the stage's peers computed (forward and backward) vs the throughput they announce.",
        unit="short",
        w=12,
    ),
    panel(
        "Requests in flight per peer",
        "timeseries",
        [target("swarm_peer_requests_in_flight", "{{instance}}")],
        description="Queue depth: requests being received, waiting for compute, or computed.",
        w=12,
    ),
    panel(
        "Compute utilisation per peer",
        "timeseries",
        [target(f"rate(swarm_peer_compute_busy_seconds_total[{RATE}])", "{{instance}}")],
        description="The fraction of wall time the peer's stage computed (its compute thread; on CUDA its stream).",
        unit="percentunit",
        w=12,
    ),
    panel(
        "Where the peers' time goes",
        "timeseries",
        [target(f"sum by (phase) (rate(swarm_peer_phase_seconds_total[{RATE}]))", "{{phase}}")],
        description="Seconds per second each phase of the peers' requests took (receive, decode, queue, compute, "
        "encode, serialize, send, hop_wait, hop_decode); phases of requests in flight overlap.",
        unit="s",
        w=12,
    ),
    panel(
        "Peer request latency (p90)",
        "timeseries",
        [
            target(
                "histogram_quantile(0.9, sum by (le, stage, rpc) "
                f"(rate(swarm_peer_request_duration_seconds_bucket[{RATE}])))",
                "stage {{stage}} {{rpc}}",
            ),
            target(
                "histogram_quantile(0.9, sum by (le, stage, rpc) "
                f"(rate(swarm_peer_queue_duration_seconds_bucket[{RATE}])))",
                "stage {{stage}} {{rpc}} queued",
            ),
        ],
        unit="s",
        w=12,
    ),
    panel(
        "Trainer call latency (p90)",
        "timeseries",
        [
            target(
                "histogram_quantile(0.9, sum by (le, stage, rpc) "
                f"(rate(swarm_trainer_call_duration_seconds_bucket[{RATE}])))",
                "stage {{stage}} {{rpc}}",
            )
        ],
        description="Round trip of successful calls, transfer and compute included.",
        unit="s",
        w=12,
    ),
    panel(
        "Memory per process",
        "timeseries",
        [
            target("process_resident_memory_bytes", "{{instance}} resident"),
            target("swarm_peer_device_memory_peak_bytes > 0", "{{instance}} GPU peak"),
        ],
        description="Each scraped process's resident memory, and the most GPU memory a GPU peer's tensors took.",
        unit="bytes",
        w=24,
    ),
    row("Network"),
    panel(
        "Bytes/s by codec",
        "timeseries",
        [
            target(f"sum by (codec) (rate(swarm_trainer_sent_bytes_total[{RATE}]))", "trainer sent {{codec}}"),
            target(f"sum by (codec) (rate(swarm_trainer_received_bytes_total[{RATE}]))", "trainer received {{codec}}"),
            target(f"sum by (codec) (rate(swarm_peer_sent_bytes_total[{RATE}]))", "peers sent {{codec}}"),
            target(f"sum by (codec) (rate(swarm_peer_received_bytes_total[{RATE}]))", "peers received {{codec}}"),
        ],
        description="Tensor payload bytes on the wire, by codec.",
        unit="Bps",
        w=12,
    ),
    panel(
        "Compression ratio by codec",
        "timeseries",
        [
            target(
                f"sum by (codec) (rate(swarm_peer_sent_uncompressed_bytes_total[{RATE}])) "
                f"/ sum by (codec) (rate(swarm_peer_sent_bytes_total[{RATE}]))",
                "peers {{codec}}",
            ),
            target(
                f"sum by (codec) (rate(swarm_trainer_sent_uncompressed_bytes_total[{RATE}])) "
                f"/ sum by (codec) (rate(swarm_trainer_sent_bytes_total[{RATE}]))",
                "trainer {{codec}}",
            ),
        ],
        description="Uncompressed size / size on the wire.",
        w=12,
    ),
    row("Failures"),
    panel(
        "Failed calls (trainer) and requests (peers)",
        "timeseries",
        [
            target(
                f"sum by (stage, kind) (rate(swarm_trainer_call_failures_total[{RATE}]))",
                "trainer: stage {{stage}} {{kind}}",
            ),
            target(
                f"sum by (stage, kind) (rate(swarm_peer_request_failures_total[{RATE}]))",
                "peers: stage {{stage}} {{kind}}",
            ),
        ],
        unit="reqps",
        w=12,
    ),
    panel(
        "Retries, bans and waits",
        "timeseries",
        [
            target(f"sum by (stage) (rate(swarm_trainer_retries_total[{RATE}]))", "retries stage {{stage}}"),
            target(f"sum by (stage) (rate(swarm_trainer_bans_total[{RATE}]))", "bans stage {{stage}}"),
            target(
                f"sum by (stage) (rate(swarm_trainer_stage_wait_seconds_total[{RATE}]))",
                "waiting for stage {{stage}} (s/s)",
            ),
        ],
        w=12,
    ),
    row("Contributions and spot checks"),
    panel(
        "What each peer did for the trainer",
        "table",
        [
            target("swarm_trainer_peer_samples_served", "", instant=True, table=True),
            target("swarm_trainer_peer_calls_answered", "", instant=True, table=True),
            target("swarm_trainer_peer_calls_failed", "", instant=True, table=True),
            target("swarm_trainer_peer_calls_verified", "", instant=True, table=True),
            target("swarm_trainer_peer_mismatches", "", instant=True, table=True),
            target("swarm_trainer_peer_banned", "", instant=True, table=True),
            target("swarm_trainer_peer_samples_verified", "", instant=True, table=True),
            target("swarm_trainer_peer_disputes", "", instant=True, table=True),
        ],
        description="Per peer (id's last 8 characters) and stage, since the trainer started: training samples "
        "served (backward calls answered), calls answered and failed, spot checks its answer took part in, mismatches (it disagreed and "
        "was not the majority), banned (1; the reason is in the trainer's report and `swarm status --report`), "
        "samples checked right (of its own calls: the useful work a check has shown) and disputes (its answer and "
        "one other differed with no third replica to tell). "
        "At most 32 peers per trainer: the banned first, then those that served most.",
        w=16,
        h=8,
        options={"showHeader": True},
        transformations=[
            {"id": "merge", "options": {}},  # one row per (trainer, peer, stage)
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "__name__": True, "job": True},
                    "renameByName": {
                        "Value #A": "samples",
                        "Value #B": "answered",
                        "Value #C": "failed",
                        "Value #D": "verified",
                        "Value #E": "mismatches",
                        "Value #F": "banned",
                        "Value #G": "samples checked right",
                        "Value #H": "disputes",
                    },
                },
            },
        ],
    ),
    panel(
        "Spot checks: cost and catches",
        "timeseries",
        [
            target(f"sum by (stage) (rate(swarm_trainer_calls_verified_total[{RATE}]))", "verified stage {{stage}}"),
            target(
                f"sum by (stage) (rate(swarm_trainer_verify_mismatches_total[{RATE}]))", "mismatches stage {{stage}}"
            ),
            target(f"sum by (stage) (increase(swarm_trainer_verify_bans_total[{RATE}]))", "bans stage {{stage}}"),
            target(
                f"sum by (stage) (increase(swarm_trainer_verify_disputes_total[{RATE}]))", "disputes stage {{stage}}"
            ),
            target(f"sum by (stage) (increase(swarm_trainer_verify_stale_total[{RATE}]))", "stale stage {{stage}}"),
        ],
        description="Calls also recomputed by a second replica (--verify-fraction: forwards, the last stage's "
        "fused calls, backwards), those whose answers differed, replicas banned for the run by a check, and "
        "disputes (two answers apart with no third replica to ask: nobody banned), and checks not compared "
        "because another trainer's commit stepped the replicas in between (stale).",
        w=8,
    ),
    row("Averaging, rebalancing, checkpoints"),
    panel(
        "Averaging",
        "timeseries",
        [
            target(f"sum by (result) (rate(swarm_peer_averaging_rounds_total[{RATE}]))", "rounds {{result}}"),
            target(f"sum by (direction) (rate(swarm_peer_averaging_bytes_total[{RATE}]))", "bytes {{direction}}"),
        ],
        w=8,
    ),
    panel(
        "Rebalancing moves",
        "timeseries",
        [target(f"sum(increase(swarm_peer_rebalance_moves_total[{RATE}]))", "moves")],
        w=8,
    ),
    panel(
        "Checkpoints and optimizer steps",
        "timeseries",
        [
            target(f"sum by (result) (increase(swarm_peer_checkpoint_saves_total[{RATE}]))", "saves {{result}}"),
            target(
                f"sum by (stage) (rate(swarm_peer_optimizer_steps_total[{RATE}]) * on (instance, job) "
                "group_left (stage) swarm_peer_stage_info)",
                "optimizer steps/s stage {{stage}}",
            ),
        ],
        w=8,
    ),
]


def layout(panels: list[dict]) -> list[dict]:
    """Place panels left to right, wrapping at the grid width; give each an id."""
    x = y = row_h = 0
    placed = []
    for i, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > WIDTH:
            x, y, row_h = 0, y + row_h, 0
        placed.append({**p, "id": i, "gridPos": {"x": x, "y": y, "w": w, "h": h}})
        x, row_h = x + w, max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return placed


def dashboard() -> dict:
    return {
        "uid": "swarm-overview",
        "title": "Swarm overview",
        "description": "Stages and replicas, throughput per stage, bytes per codec, failures, loss.",
        "tags": ["swarm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": "Prometheus", "value": "swarm-prometheus"},
                    "hide": 0,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": layout(PANELS),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboards", "swarm.json")

if __name__ == "__main__":
    with open(PATH, "w") as f:
        f.write(render())
    print(f"wrote {PATH}")
