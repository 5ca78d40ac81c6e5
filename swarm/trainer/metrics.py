"""The trainer's Prometheus metrics, all defined here, named `swarm_trainer_<what>_<unit>`.

Labels only take bounded values: a stage index, an rpc name, a failure kind (`wire.failures.Failure`),
a codec name. A peer id only in the per-peer contribution gauges (`swarm_trainer_peer_*`), shortened
to its last 8 characters and for at most `EXPORTED_PEERS` peers (the banned ones first, then those
that served most): a swarm of thousands of volunteers cannot blow up the series count. Updates come
from the event loop (pipeline, training loop); nothing here reads the pipeline's own structures from
the HTTP thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from peers.metrics import LATENCY_BUCKETS_S, ByteCounterCollector, TransportCollector
from process.phase_times import PhaseCollector, PhaseTotal

EXPORTED_PEERS = 32  # per-peer contribution series: at most this many peers
PEER_COUNTS = {  # ContributionLedger field -> (gauge name, help)
    "samples_served": (
        "swarm_trainer_peer_samples_served",
        "Training samples the peer answered backward calls for (its share of its stage's work)",
    ),
    "calls_answered": ("swarm_trainer_peer_calls_answered", "Calls to the peer it answered (any rpc)"),
    "calls_failed": ("swarm_trainer_peer_calls_failed", "Calls to the peer that failed"),
    "calls_verified": ("swarm_trainer_peer_calls_verified", "Spot checks the peer's answer took part in"),
    "mismatches": (
        "swarm_trainer_peer_mismatches",
        "Spot checks where the peer's answer disagreed and was not the majority's",
    ),
    "samples_verified": (
        "swarm_trainer_peer_samples_verified",
        "Samples of the peer's own calls that a spot check found right (useful work shown)",
    ),
    "disputes": (
        "swarm_trainer_peer_disputes",
        "Spot checks where the peer's answer and one other differed with no third replica to tell",
    ),
}


def short_peer_id(peer_id: str) -> str:
    """The label a peer gets in metrics (its id's last 8 characters, as in the logs and the report)."""
    return peer_id[-8:]


# The trainer's phases, `swarm_trainer_phase_*{phase}` (process/phase_times.py).
TRAINER_PHASES = {
    "encode": "tensors encoded for a call (CPU too)",
    "decode": "an answer's tensors decoded (CPU too)",
    "call": "a call's wall time, from its request handed over to its answer read (hub: one stage; direct: a chain)",
    "commit": "a step's commit, from its last microbatch's answer to every replica's (the peers wait meanwhile)",
}

STEP_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class TrainerMetrics:
    """Every metric a trainer exports, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=r)
        self.info = Gauge(
            "swarm_trainer_info",
            "1, labelled with the run's model, stage count and codec mode",
            ["model", "num_stages", "codec"],
            registry=r,
        )
        # progress
        self.step = Gauge("swarm_trainer_step", "Optimizer steps completed", registry=r)
        self.target_steps = Gauge("swarm_trainer_target_steps", "Steps this run will train (--steps)", registry=r)
        self.loss = Gauge("swarm_trainer_loss", "Mean cross-entropy (nats) of the last step", registry=r)
        self.eval_loss = Gauge(
            "swarm_trainer_eval_loss",
            "Mean cross-entropy (nats) on the validation batches, last evaluation",
            registry=r,
        )
        self.tokens = Counter("swarm_trainer_tokens_total", "Tokens trained on (rate() = tokens/s)", registry=r)
        self.tokens_per_second = Gauge("swarm_trainer_tokens_per_second", "Tokens/s of the last step", registry=r)
        self.step_duration = Histogram(
            "swarm_trainer_step_duration_seconds", "Wall time of one optimizer step", buckets=STEP_BUCKETS_S, registry=r
        )
        self.microbatches = Counter("swarm_trainer_microbatches_total", "Microbatches through every stage", registry=r)
        self.microbatches_retried = Counter(
            "swarm_trainer_microbatches_retried_total", "Microbatches that needed at least one retry", registry=r
        )
        # the swarm as this trainer sees it
        self.live_replicas = Gauge(
            "swarm_trainer_live_replicas", "Online replicas of each stage in the DHT", ["stage"], registry=r
        )
        self.stage_throughput = Gauge(
            "swarm_trainer_stage_throughput_samples_per_second",
            "Sum of the throughput the stage's online replicas announce",
            ["stage"],
            registry=r,
        )
        # calls to peers
        self.calls = Counter(
            "swarm_trainer_calls_total",
            "Calls to a stage replica (each attempt, failed or not)",
            ["stage", "rpc"],
            registry=r,
        )
        self.call_failures = Counter(
            "swarm_trainer_call_failures_total",
            "Failed calls, by kind (timeout, transport, refused, wrong_stage, internal, garbage)",
            ["stage", "rpc", "kind"],
            registry=r,
        )
        self.call_duration = Histogram(
            "swarm_trainer_call_duration_seconds",
            "Round trip of a successful call",
            ["stage", "rpc"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "swarm_trainer_retries_total", "Calls retried on another replica after a failure", ["stage"], registry=r
        )
        self.bans = Counter("swarm_trainer_bans_total", "Replicas banned after a failure", ["stage"], registry=r)
        # spot checks (swarm/trainer/spot_checks.py): their cost is these extra calls
        self.calls_verified = Counter(
            "swarm_trainer_calls_verified_total",
            "Calls also recomputed by a second replica to compare the answers (--verify-fraction)",
            ["stage"],
            registry=r,
        )
        self.verify_mismatches = Counter(
            "swarm_trainer_verify_mismatches_total",
            "Verified calls whose two answers differed beyond the tolerance (a third replica is asked)",
            ["stage"],
            registry=r,
        )
        self.verify_bans = Counter(
            "swarm_trainer_verify_bans_total",
            "Replicas banned for the run: their answer was in the minority of a spot check",
            ["stage"],
            registry=r,
        )
        self.verify_disputes = Counter(
            "swarm_trainer_verify_disputes_total",
            "Spot checks whose two answers differed with no third replica to ask (nobody banned)",
            ["stage"],
            registry=r,
        )
        self.verify_stale = Counter(
            "swarm_trainer_verify_stale_total",
            "Spot checks not compared: another trainer's commit stepped the replicas between the call and its recompute",
            ["stage"],
            registry=r,
        )
        # what each peer did for this trainer (swarm/trainer/contributions.py), since the trainer started
        self.peer_counts = {
            field: Gauge(
                name, f"{help_text}, since this trainer started (per peer, bounded)", ["peer", "stage"], registry=r
            )
            for field, (name, help_text) in PEER_COUNTS.items()
        }
        self.peer_banned = Gauge(
            "swarm_trainer_peer_banned",
            "1 if the trainer has banned the peer (see the report for why)",
            ["peer", "stage"],
            registry=r,
        )
        self._exported_peers: set[tuple[str, str]] = set()
        self.stage_wait = Counter(
            "swarm_trainer_stage_wait_seconds_total",
            "Time calls spent waiting for a usable replica of the stage (none live, or all banned)",
            ["stage"],
            registry=r,
        )

    def watch_phases(self, read: Callable[[], dict[str, PhaseTotal]]) -> None:
        """Export the trainer's phase times (TRAINER_PHASES)."""
        self.registry.register(PhaseCollector("swarm_trainer", read, "the trainer's calls"))

    def count_bytes(self, snapshot: Callable[[], dict]) -> None:
        """Export the client's ByteCounter (`swarm_trainer_{sent,received}[_uncompressed]_bytes_total{codec}`)."""
        self.registry.register(ByteCounterCollector("swarm_trainer", snapshot))

    def count_transports(self, snapshot: Callable[[], dict]) -> None:
        """Export the client's TransportStats (`swarm_trainer_transport_{calls,bytes}_total`)."""
        self.registry.register(TransportCollector("swarm_trainer", snapshot))

    def set_run(self, *, model: str, num_stages: int, codec: str, target_steps: int) -> None:
        self.info.clear()
        self.info.labels(model=model, num_stages=str(num_stages), codec=codec).set(1)
        self.target_steps.set(target_steps)
        for stage in range(num_stages):  # so that a stage that never had a replica shows as 0
            self.live_replicas.labels(stage=str(stage))
            for rpc in ("forward", "backward"):
                self.calls.labels(stage=str(stage), rpc=rpc)
            checks = (self.calls_verified, self.verify_mismatches, self.verify_bans, self.verify_disputes)
            for counter in (*checks, self.verify_stale):
                counter.labels(stage=str(stage))

    def set_contributions(self, contributions: dict[str, dict]) -> None:
        """Export the ledger's counts (peer id -> `PeerContribution` as a dict) for at most
        `EXPORTED_PEERS` peers: the banned first, then those that served the most samples."""
        ranked = sorted(
            contributions.items(), key=lambda item: (item[1]["banned"] is None, -item[1]["samples_served"], item[0])
        )
        exported = set()
        for peer_id, counts in ranked[:EXPORTED_PEERS]:
            labels = (short_peer_id(peer_id), str(counts["stage"]))
            if labels in exported:  # two ids ending alike: the first (ranked higher) shows
                continue
            exported.add(labels)
            for field, gauge in self.peer_counts.items():
                gauge.labels(*labels).set(counts.get(field, 0))
            self.peer_banned.labels(*labels).set(1 if counts["banned"] else 0)
        for labels in self._exported_peers - exported:  # a peer that moved stage, or fell out of the top
            for gauge in (*self.peer_counts.values(), self.peer_banned):
                gauge.remove(*labels)
        self._exported_peers = exported

    def set_stages(self, live: Sequence[int], throughput: Sequence[float]) -> None:
        for stage, (count, samples_per_s) in enumerate(zip(live, throughput)):
            self.live_replicas.labels(stage=str(stage)).set(count)
            self.stage_throughput.labels(stage=str(stage)).set(samples_per_s)

    def observe_step(self, *, step: int, loss: float | None, tokens: int, duration_s: float) -> None:
        """`loss` None: a global step the other trainers finished before this one sent anything."""
        self.step.set(step)
        if loss is not None:
            self.loss.set(loss)
        self.tokens.inc(tokens)
        self.tokens_per_second.set(tokens / duration_s if duration_s > 0 else 0.0)
        self.step_duration.observe(duration_s)

    def observe_call(self, *, stage: int, rpc: str, duration_s: float) -> None:
        self.calls.labels(stage=str(stage), rpc=rpc).inc()
        self.call_duration.labels(stage=str(stage), rpc=rpc).observe(duration_s)

    def observe_failure(self, *, stage: int, rpc: str, kind: str) -> None:
        self.calls.labels(stage=str(stage), rpc=rpc).inc()
        self.call_failures.labels(stage=str(stage), rpc=rpc, kind=kind).inc()
        self.retries.labels(stage=str(stage)).inc()
