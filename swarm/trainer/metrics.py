"""The trainer's Prometheus metrics, all defined here, named `swarm_trainer_<what>_<unit>`.

Labels only take bounded values: a stage index, an rpc name, a failure kind (`wire.failures.Failure`),
a codec name. Never a peer id. Updates come from the event loop (pipeline, training
loop); nothing here reads the pipeline's own structures from the HTTP thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from peers.metrics import LATENCY_BUCKETS_S, ByteCounterCollector

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
            "Forward calls also sent to a second replica to compare the answers (--verify-fraction)",
            ["stage"],
            registry=r,
        )
        self.verify_mismatches = Counter(
            "swarm_trainer_verify_mismatches_total",
            "Verified calls whose two answers differed beyond the codec's error (a third replica is asked)",
            ["stage"],
            registry=r,
        )
        self.verify_bans = Counter(
            "swarm_trainer_verify_bans_total",
            "Replicas banned for the run: their answer was in the minority of a spot check",
            ["stage"],
            registry=r,
        )
        self.stage_wait = Counter(
            "swarm_trainer_stage_wait_seconds_total",
            "Time calls spent waiting for a usable replica of the stage (none live, or all banned)",
            ["stage"],
            registry=r,
        )

    def count_bytes(self, snapshot: Callable[[], dict]) -> None:
        """Export the client's ByteCounter (`swarm_trainer_{sent,received}[_uncompressed]_bytes_total{codec}`)."""
        self.registry.register(ByteCounterCollector("swarm_trainer", snapshot))

    def set_run(self, *, model: str, num_stages: int, codec: str, target_steps: int) -> None:
        self.info.clear()
        self.info.labels(model=model, num_stages=str(num_stages), codec=codec).set(1)
        self.target_steps.set(target_steps)
        for stage in range(num_stages):  # so that a stage that never had a replica shows as 0
            self.live_replicas.labels(stage=str(stage))
            for rpc in ("forward", "backward"):
                self.calls.labels(stage=str(stage), rpc=rpc)
            for counter in (self.calls_verified, self.verify_mismatches, self.verify_bans):
                counter.labels(stage=str(stage))

    def set_stages(self, live: Sequence[int], throughput: Sequence[float]) -> None:
        for stage, (count, samples_per_s) in enumerate(zip(live, throughput)):
            self.live_replicas.labels(stage=str(stage)).set(count)
            self.stage_throughput.labels(stage=str(stage)).set(samples_per_s)

    def observe_step(self, *, step: int, loss: float, tokens: int, duration_s: float) -> None:
        self.step.set(step)
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
