"""The peer's Prometheus metrics, all defined here, named `swarm_peer_<what>_<unit>`.

Labels only ever take bounded values: a stage index, an rpc name (`forward`, `backward`), a codec
name (registered codecs only, see `wire.compression.accounting`), a failure kind, a result, an
averaging mode (`sync`, `periodic`). Never a peer id: Prometheus' own `instance` label already
tells peers apart.

Each `PeerMetrics` owns its registry (not prometheus_client's global one), so several can live in
one test process. The HTTP endpoint that serves a registry is process plumbing shared by every role
(`process.metrics_http`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from peers.compute.utilization import ComputeClock
from process.phase_times import PhaseCollector, PhaseTotal

if TYPE_CHECKING:
    from peers.replicas.averaging import AveragingRound

disable_created_metrics()  # no `*_created` series: they double the series count and no panel or rule uses them

# From a tiny model on loopback (milliseconds) to a large stage over a slow link (tens of seconds).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PEER_STATES = ("joining", "online", "offline", "standby")
UTILIZATION_WINDOW_S = 60.0  # swarm_peer_compute_utilization: the busy fraction of this many last seconds
# The phases of a request, `swarm_peer_phase_*{phase}` (process/phase_times.py). Wall seconds of each;
# CPU seconds of the synchronous ones (receive, queue, send, hop_wait and commit_wait are waits: wall only).
PHASES = {
    "receive": "from a request's first message to its last (the caller's sending and the transport)",
    "decode": "the request's tensors decoded",
    "queue": "from the whole request's arrival to its compute's start (a slot, the compute thread)",
    "compute": "the stage's forward or backward on the compute thread",
    "device_copy": "inside compute: tensors to the device and back to the host",
    "encode": "the answer's (or a hop's) tensors encoded",
    "serialize": "headers and tensor parts framed into messages",
    "send": "the answer's messages handed to the transport, serialize excluded",
    "hop_wait": "direct routing: waiting for the next stage's answer (its hop, its compute, the chain after it)",
    "hop_decode": "direct routing: the next stage's gradient decoded",
    "commit_wait": "a call sent while its trainer's commit travelled, waiting for this peer to handle that commit",
}
AVERAGING_MODES = ("sync", "periodic", "outer")  # the label values of the averaging metrics


# --- collectors read at scrape time --------------------------------------------------------------
class ByteCounterCollector(Collector):
    """Exposes a `wire.compression.ByteCounter` (thread-safe snapshot) as per-codec counters:
    `<prefix>_{sent,received}_bytes_total` (on the wire) and `..._uncompressed_bytes_total`."""

    def __init__(self, prefix: str, snapshot: Callable[[], dict]):
        self.prefix, self.snapshot = prefix, snapshot

    def _families(self, snapshot: dict) -> list[CounterMetricFamily]:
        families = []
        for direction in ("sent", "received"):
            wire = CounterMetricFamily(
                f"{self.prefix}_{direction}_bytes",
                f"Tensor payload bytes {direction} on the wire, by codec",
                labels=["codec"],
            )
            raw = CounterMetricFamily(
                f"{self.prefix}_{direction}_uncompressed_bytes",
                f"What the tensors {direction} take uncompressed, by codec",
                labels=["codec"],
            )
            for codec, totals in sorted(snapshot.get(direction, {}).items()):
                wire.add_metric([codec], totals["wire_bytes"])
                raw.add_metric([codec], totals["original_bytes"])
            families += [wire, raw]
        return families

    def collect(self) -> Iterable[CounterMetricFamily]:
        return self._families(self.snapshot())

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families({})


class TransportCollector(Collector):
    """Exposes a `wire.transport_stats.TransportStats` as `<prefix>_transport_calls_total{transport,side,rpc}`
    (calls `made` and `served`, over `direct`: the data plane, or `p2pd`) and
    `<prefix>_transport_bytes_total{transport,direction}` (their metadata and tensor bytes)."""

    def __init__(self, prefix: str, snapshot: Callable[[], dict]):
        self.prefix, self.snapshot = prefix, snapshot

    def _families(self, snapshot: dict) -> list[CounterMetricFamily]:
        calls = CounterMetricFamily(
            f"{self.prefix}_transport_calls",
            "Streamed calls by transport (direct: the data plane; p2pd), made and served",
            labels=["transport", "side", "rpc"],
        )
        nbytes = CounterMetricFamily(
            f"{self.prefix}_transport_bytes",
            "Bytes of the streamed calls' messages (headers and tensor parts) by transport, sent and received",
            labels=["transport", "direction"],
        )
        for (transport, side, rpc), count in sorted(snapshot.get("calls", {}).items()):
            calls.add_metric([transport, side, rpc], count)
        for (transport, direction), count in sorted(snapshot.get("bytes", {}).items()):
            nbytes.add_metric([transport, direction], count)
        return [calls, nbytes]

    def collect(self) -> Iterable[CounterMetricFamily]:
        return self._families(self.snapshot())

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families({})


class _CallbackCounters(Collector):
    """Counters whose totals live elsewhere (the stage runtime) and are read at scrape time."""

    def __init__(self, read: Callable[[], tuple[int, int, int, int, int]]):
        self.read = read

    def _families(self, values: tuple[int, int, int, int, int] | None) -> list[CounterMetricFamily]:
        steps = CounterMetricFamily("swarm_peer_optimizer_steps", "Optimizer steps this peer applied to its stage")
        cache = CounterMetricFamily(
            "swarm_peer_activation_cache_lookups",
            "Backward requests that found their forward activations cached (hit) or recomputed them (miss)",
            labels=["result"],
        )
        trained = CounterMetricFamily(
            "swarm_peer_samples_accumulated", "Samples whose gradients this peer added to its stage's step"
        )
        repeats = CounterMetricFamily(
            "swarm_peer_backward_repeats",
            "Backwards of a microbatch already counted in the step (a retry after a lost answer): "
            "answered, their gradients not added again",
        )
        if values is not None:
            steps_done, hits, misses, samples_trained, backward_repeats = values
            steps.add_metric([], steps_done)
            cache.add_metric(["hit"], hits)
            cache.add_metric(["miss"], misses)
            trained.add_metric([], samples_trained)
            repeats.add_metric([], backward_repeats)
        return [steps, cache, trained, repeats]

    def collect(self) -> Iterable[CounterMetricFamily]:
        return self._families(self.read())

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families(None)


class _BusyCounter(Collector):
    def __init__(self, clock: ComputeClock):
        self.clock = clock

    def _families(self, busy_s: float | None) -> list[CounterMetricFamily]:
        busy = CounterMetricFamily(
            "swarm_peer_compute_busy_seconds",
            "Seconds the stage's compute was busy (rate() = the compute utilisation; on CUDA, the stream's time)",
        )
        if busy_s is not None:
            busy.add_metric([], busy_s)
        return [busy]

    def collect(self) -> Iterable[CounterMetricFamily]:
        return self._families(self.clock.busy_s())

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families(None)


# --- the peer's metrics --------------------------------------------------------------------------
class PeerMetrics:
    """Every metric a peer exports. The server calls the `observe_*` / `set_*` methods; values owned
    by other objects are read at scrape time through `watch` and `count_bytes`."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.stage_info = Gauge(
            "swarm_peer_stage_info",
            "1 for the stage this peer serves now",
            ["stage", "num_stages", "version"],
            registry=r,
        )
        self.state = Gauge(
            "swarm_peer_state", "1 for the peer's current state (joining, online, offline)", ["state"], registry=r
        )
        self.requests = Counter(
            "swarm_peer_requests_total", "RPC requests handled (served or failed)", ["stage", "rpc"], registry=r
        )
        self.failures = Counter(
            "swarm_peer_request_failures_total",
            "RPC requests answered with an error, by kind "
            "(bad_request, wrong_stage, too_large, rate_limited, not_allowed, internal)",
            ["stage", "rpc", "kind"],
            registry=r,
        )
        self.samples = Counter(
            "swarm_peer_samples_total",
            "Samples computed in served requests (rate() = samples/s)",
            ["stage", "rpc"],
            registry=r,
        )
        self.request_duration = Histogram(
            "swarm_peer_request_duration_seconds",
            "From the first request message to the answer ready to send",
            ["stage", "rpc"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_duration = Histogram(
            "swarm_peer_queue_duration_seconds",
            "Time from a request's full arrival "
            "to the start of its compute (decoding, waiting for a slot and for the "
            "compute thread)",
            ["stage", "rpc"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.compute_duration = Histogram(
            "swarm_peer_compute_duration_seconds",
            "Time a request ran on the compute thread (its wait for that thread is in the queue duration)",
            ["stage", "rpc"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "swarm_peer_requests_in_flight", "Requests being received, queued or computed", registry=r
        )
        self.throughput = Gauge(
            "swarm_peer_throughput_samples_per_second",
            "Measured compute throughput the peer announces (EMA)",
            registry=r,
        )
        self.compute_utilization = Gauge(
            "swarm_peer_compute_utilization",
            f"Fraction of the last {UTILIZATION_WINDOW_S:.0f} s the stage's compute was busy (the compute "
            "thread; on CUDA its stream)",
            registry=r,
        )
        self.device_memory_peak = Gauge(
            "swarm_peer_device_memory_peak_bytes",
            "Peak GPU memory this peer's tensors took (0 on a CPU peer: see process_resident_memory_bytes)",
            registry=r,
        )
        self.announcements = Counter(
            "swarm_peer_announcements_total", "DHT announcements of this peer's record", ["result"], registry=r
        )
        self.checkpoint_saves = Counter("swarm_peer_checkpoint_saves_total", "Checkpoint saves", ["result"], registry=r)
        # Averaging (peers/replicas/averaging.py): updated by `observe_averaging_round`, mode = sync or periodic.
        self.averaging_rounds = Counter(
            "swarm_peer_averaging_rounds_total",
            "Averaging rounds with the stage's "
            "other replicas (result=failed: no group formed in time, or the all-reduce "
            "failed)",
            ["mode", "result"],
            registry=r,
        )
        self.averaging_bytes = Counter(
            "swarm_peer_averaging_bytes_total",
            "Tensor bytes averaging sent and received "
            "(computed per round from the group size and the codec's serialized size)",
            ["mode", "direction"],
            registry=r,
        )
        self.averaging_group_size = Gauge(
            "swarm_peer_averaging_group_size",
            "Replicas in the last successful averaging round, this peer included",
            ["mode"],
            registry=r,
        )
        # Wired in by the rebalancing code; defined here so dashboards can rely on it.
        self.rebalance_moves = Counter(
            "swarm_peer_rebalance_moves_total", "Times this peer moved to another stage", registry=r
        )
        for result in ("ok", "failed"):
            self.announcements.labels(result=result)
        for result in ("ok", "error"):
            self.checkpoint_saves.labels(result=result)

    # --- wiring ----------------------------------------------------------------------------------
    def watch(
        self,
        *,
        in_flight: Callable[[], float],
        throughput: Callable[[], float],
        runtime_counts: Callable[[], tuple[int, int, int, int, int]],
        device_memory_peak: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """Read these at scrape time: requests in flight, announced throughput,
        (optimizer steps, activation cache hits, misses, samples accumulated, backward repeats), and the
        compute device's peak memory."""
        self.in_flight.set_function(in_flight)
        self.throughput.set_function(throughput)
        self.device_memory_peak.set_function(device_memory_peak)
        self.registry.register(_CallbackCounters(runtime_counts))

    def watch_compute(self, clock: ComputeClock, phases: Callable[[], dict[str, PhaseTotal]]) -> None:
        """Export the compute clock (`swarm_peer_compute_busy_seconds_total`, whose rate() is the
        utilisation, and `swarm_peer_compute_utilization` over the last UTILIZATION_WINDOW_S) and
        the requests' phase times (`swarm_peer_phase_*{phase}`, PHASES)."""
        self.compute_utilization.set_function(lambda: clock.utilization(UTILIZATION_WINDOW_S))
        self.registry.register(_BusyCounter(clock))
        self.registry.register(PhaseCollector("swarm_peer", phases, "a peer's requests"))

    def count_bytes(self, snapshot: Callable[[], dict]) -> None:
        """Export a ByteCounter's totals (pass its `snapshot` method)."""
        self.registry.register(ByteCounterCollector("swarm_peer", snapshot))

    def count_transports(self, snapshot: Callable[[], dict]) -> None:
        """Export a TransportStats' totals (pass its `snapshot` method)."""
        self.registry.register(TransportCollector("swarm_peer", snapshot))

    # --- updates ---------------------------------------------------------------------------------
    def set_serving(self, *, stage: int, num_stages: int, version: str) -> None:
        """The stage served now (after a move the old one disappears)."""
        self.stage_info.clear()
        self.stage_info.labels(stage=str(stage), num_stages=str(num_stages), version=version).set(1)

    def set_averaging_mode(self, mode: str) -> None:
        """Show the averaging series of this peer's mode at zero from the start (none: no series)."""
        if mode in AVERAGING_MODES:
            for result in ("ok", "failed"):
                self.averaging_rounds.labels(mode=mode, result=result)
            for direction in ("sent", "received"):
                self.averaging_bytes.labels(mode=mode, direction=direction)

    def observe_averaging_round(self, averaging_round: AveragingRound) -> None:
        """Called by the averager (on the compute thread) after every attempted round."""
        mode = averaging_round.mode
        self.averaging_rounds.labels(mode=mode, result="ok" if averaging_round.ok else "failed").inc()
        if averaging_round.ok:
            self.averaging_bytes.labels(mode=mode, direction="sent").inc(averaging_round.sent_bytes)
            self.averaging_bytes.labels(mode=mode, direction="received").inc(averaging_round.received_bytes)
            self.averaging_group_size.labels(mode=mode).set(averaging_round.group_size)

    def set_state(self, state: str) -> None:
        for name in PEER_STATES:
            self.state.labels(state=name).set(1 if name == state else 0)

    def observe_request(
        self,
        *,
        stage: int,
        rpc: str,
        duration_s: float,
        samples: int = 0,
        queue_s: float | None = None,
        compute_s: float | None = None,
        failure_kind: str | None = None,
    ) -> None:
        labels = dict(stage=str(stage), rpc=rpc)
        self.requests.labels(**labels).inc()
        self.request_duration.labels(**labels).observe(duration_s)
        if failure_kind is not None:
            self.failures.labels(**labels, kind=failure_kind).inc()
            return
        self.samples.labels(**labels).inc(samples)
        if queue_s is not None:
            self.queue_duration.labels(**labels).observe(queue_s)
        if compute_s is not None:
            self.compute_duration.labels(**labels).observe(compute_s)
