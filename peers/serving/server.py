"""The peer server: hosts one stage over hivemind's P2P and keeps its DHT record fresh.

Async code on the peer lives in this layer and nowhere else: `PeerServer` owns the lifecycle (DHT
record, announcer, checkpoints, start and stop) and mixes in the RPC handlers of
peers/serving/stage_rpc.py (forward/backward) and peers/replicas/replica_sync.py (commit, state, averaging). Compute
runs on one dedicated thread (`StageRuntime`). peers/launch.py builds a server from a `PeerConfig`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import hivemind
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from dht.announce import announce, fetch_stage_records_async
from dht.reachability import (
    DialBackService,
    ReachabilityReport,
    address_scope,
    check_reachability,
    direct_maddrs,
    verdict,
)
from dht.records import PeerRecord, PeerState, SplitRecord
from dht.split_agreement import publish_split_async
from peers.compute.checkpoint import checkpoint_path
from peers.compute.stage_builder import StageBuilder
from peers.compute.stage_runtime import StageRuntime
from peers.config import PeerConfig
from peers.health import write_status
from peers.metrics import PeerMetrics
from peers.placement.link_probe import register_probe_handler, start_link_probing
from peers.placement.split_claim import renewed, split_tag
from peers.placement.stage_moves import StageMoves
from peers.replicas.averaging import GradientSync, ParameterAveraging
from peers.replicas.replica_sync import ReplicaSyncHandlers
from peers.serving.stage_rpc import StageRpcHandlers
from process.version import software_version
from wire import compression
from wire.protocol import RPC_BACKWARD, RPC_COMMIT, RPC_FORWARD, RPC_STATE
from wire.request_limits import PenaltyBox

logger = logging.getLogger(__name__)


class PeerServer(StageRpcHandlers, ReplicaSyncHandlers, StageMoves):
    def __init__(
        self,
        config: PeerConfig,
        runtime: StageRuntime,
        dht: hivemind.DHT,
        averaging: GradientSync | ParameterAveraging | None = None,
        *,
        metrics: PeerMetrics | None = None,
        metrics_addr: str | None = None,
        split: SplitRecord | None = None,
        builder: StageBuilder | None = None,
    ):
        self.config, self.runtime, self.dht = config, runtime, dht
        self.averaging = averaging
        self.metrics, self.metrics_addr = metrics or PeerMetrics(), metrics_addr
        self.split, self.split_tag = split, split_tag(split, runtime.config.n_layers) if split else None
        self.peer_id = dht.peer_id.to_base58()
        self.builder = builder  # builds another stage's runtime when this peer moves (peers/placement/stage_moves.py)
        self.moving_to: int | None = None  # while moving: the stage announced as joining
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self.in_flight = 0
        self.requests_served = 0
        self.requests_failed = 0
        self.state = PeerState.JOINING
        self.online_since = time.monotonic()
        self.announced_online_at: float | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self.penalties = PenaltyBox(burst=config.bad_request_burst, refill_per_s=config.bad_request_refill_per_s)
        self.bytes = compression.ByteCounter()
        self.feedback = compression.ErrorFeedback()
        self.metrics.watch(
            in_flight=lambda: self.in_flight,
            throughput=lambda: self.runtime.throughput.value,
            runtime_counts=lambda: (self.runtime.steps_done, self.runtime.cache_hits, self.runtime.cache_misses),
        )
        self.metrics.count_bytes(self.bytes.snapshot)
        self.metrics.set_serving(stage=runtime.stage, num_stages=runtime.num_stages, version=software_version())
        self.metrics.set_state(self.state.value)

    # --- DHT record ------------------------------------------------------------------------------
    def record(self, *, stage: int | None = None, state: PeerState | None = None) -> PeerRecord:
        """This peer's record; `stage`/`state` override what it serves now (a move announces both)."""
        if stage is None:
            stage = self.moving_to if self.moving_to is not None else self.runtime.stage
        return PeerRecord(
            peer_id=self.peer_id,
            model=self.config.model,
            stage=stage,
            num_stages=self.runtime.num_stages,
            state=state or self.state,
            throughput=float(self.runtime.throughput.value),
            load=float(self.in_flight),
            version=software_version(),
            expires_at=get_dht_time() + self.config.record_ttl_s,
            averaging=self.config.averaging,
            metrics_addr=self.metrics_addr,
        )

    async def _announce_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            stored = await announce(self.dht, self.record())
            self.metrics.announcements.labels(result="ok" if stored else "failed").inc()
            if stored and self.announced_online_at is None and self.state == PeerState.ONLINE:
                self.announced_online_at = time.monotonic()
            if self.split is not None:
                await publish_split_async(self.dht, renewed(self.split, active=True, ttl_s=self.config.record_ttl_s))
            self._report_status(stored)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.announce_period_s)
            except TimeoutError:
                pass

    def _report_status(self, announced: bool) -> None:
        """With --status-file: what `python -m peers.health` (the container's HEALTHCHECK) reads."""
        if self.config.status_file:
            write_status(
                self.config.status_file,
                self.record(),
                announced=announced,
                ttl_s=self.config.record_ttl_s,
                requests_served=self.requests_served,
                requests_failed=self.requests_failed,
            )

    # --- checkpoints -----------------------------------------------------------------------------
    def checkpoint_file(self) -> str:
        return checkpoint_path(
            self.config.checkpoint_dir, self.config.model, self.runtime.stage, self.runtime.num_stages, self.split_tag
        )

    def save_checkpoint(self) -> None:
        """Runs on the compute thread, so it never sees a half-applied optimizer step."""
        try:
            self.runtime.save(self.checkpoint_file(), self.config.model)
            self.metrics.checkpoint_saves.labels(result="ok").inc()
        except OSError as e:  # a full disk must not kill the peer; the previous checkpoint stays intact
            self.metrics.checkpoint_saves.labels(result="error").inc()
            logger.error(f"Could not save the checkpoint {self.checkpoint_file()!r}: {e}")

    async def _checkpoint_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.checkpoint_period_s)
            except TimeoutError:
                await asyncio.get_running_loop().run_in_executor(self.executor, self.save_checkpoint)

    async def _report_reachability(self, p2p) -> None:
        """Ask a few online peers of this model to dial this one back, and print the verdict."""
        maddrs = direct_maddrs(str(m) for m in await p2p.get_visible_maddrs())
        if self.config.reachability_check == "auto" and all(address_scope(m) == "loopback" for m in maddrs):
            print(
                verdict(
                    ReachabilityReport(tuple(maddrs), asked=0, reachable_by=0),
                    use_auto_relay=self.config.use_auto_relay,
                ),
                flush=True,
            )
            return
        helpers = set()
        for stage in range(self.runtime.num_stages):
            records = await fetch_stage_records_async(self.dht, self.config.model, stage)
            helpers |= {r.peer_id for r in records if r.state == PeerState.ONLINE and r.peer_id != self.peer_id}
        report = await check_reachability(p2p, helpers, maddrs=maddrs)
        print(verdict(report, use_auto_relay=self.config.use_auto_relay), flush=True)

    # --- lifecycle -------------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event) -> None:
        self._semaphore = asyncio.Semaphore(self.config.max_concurrent_requests)
        p2p = await self.dht.replicate_p2p()
        await p2p.add_protobuf_handler(
            RPC_FORWARD, self.rpc_forward, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
        )
        await p2p.add_protobuf_handler(
            RPC_BACKWARD, self.rpc_backward, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
        )
        await p2p.add_protobuf_handler(RPC_COMMIT, self.rpc_commit, runtime_pb2.ExpertRequest)
        await p2p.add_protobuf_handler(RPC_STATE, self.rpc_state, runtime_pb2.ExpertRequest, stream_output=True)
        await register_probe_handler(p2p)  # other peers measure their link to us
        await DialBackService().register(p2p)  # lets joining peers check that they are reachable
        if self.config.standby:  # backup pool: wait, holding a copy of a stage, until one needs us
            if not await self._stand_by(p2p, stop):
                await self._leave_standby()
                return
        elif self.config.load_state:
            await announce(self.dht, self.record())  # joining: trainers do not route here yet
            await self._load_state_from_replica(p2p)
        self.state = PeerState.ONLINE
        self.metrics.set_state(self.state.value)
        self.online_since = time.monotonic()
        announcer = asyncio.create_task(self._announce_forever(stop))
        rebalancer = (
            asyncio.create_task(self._rebalance_forever(p2p, stop))
            if self.config.rebalance_period_s > 0 and self.builder is not None
            else None
        )
        checkpointer = asyncio.create_task(self._checkpoint_forever(stop)) if self.config.checkpoint_dir else None
        averager = (
            asyncio.create_task(self._average_parameters_forever(stop))
            if isinstance(self.averaging, ParameterAveraging) and not self.averaging.rounds_schedule.by_steps
            else None
        )  # by steps, rounds follow the trainer's commits (rpc_commit)
        prober = start_link_probing(self, p2p, stop)  # our links to others, for `swarm plan --from-dht`
        reachability = (
            asyncio.create_task(self._report_reachability(p2p)) if self.config.reachability_check != "off" else None
        )
        print(
            f"peer {self.peer_id} online: {self.config.model} stage {self.runtime.stage}/{self.runtime.num_stages} "
            f"({self.runtime.throughput.value:.1f} samples/s measured)",
            flush=True,
        )
        try:
            await stop.wait()
        finally:
            if rebalancer is not None:  # a move under way finishes first, so that offline is the last word
                await rebalancer
            if reachability is not None:
                reachability.cancel()
                await asyncio.gather(reachability, return_exceptions=True)
            self.state = PeerState.OFFLINE
            self.metrics.set_state(self.state.value)
            await announcer
            if prober is not None:
                await prober
            self._report_status(await announce(self.dht, self.record(), timeout_s=5.0))
            if averager is not None:
                await averager
            if self.split is not None:  # our claim on the split no longer binds anyone
                await publish_split_async(
                    self.dht, renewed(self.split, active=False, ttl_s=self.config.record_ttl_s), timeout_s=5.0
                )
            if checkpointer is not None:
                await checkpointer
                await asyncio.get_running_loop().run_in_executor(self.executor, self.save_checkpoint)
            print(f"peer {self.peer_id} offline after serving {self.requests_served} requests", flush=True)
            self.executor.shutdown(wait=False, cancel_futures=True)
            if self.averaging is not None:
                self.averaging.shutdown()
