"""The peer host: hosts one stage over hivemind's P2P, as a composition of small services.

`PeerHost` owns what lives as long as the peer: the DHT node, the compute thread, the serving state
and the lifecycle (start, serve, stop, in that order). Each service receives what it needs and no more:

    StageRpcService     forward/backward (peers/serving/stage_rpc.py)
    ChainService        direct routing's chained training pass, stage to stage (peers/serving/chain_rpc.py),
                        its hops in pieces on several streams (peers/serving/hop_pieces.py)
    DataPlaneOffers     how callers reach this peer's data plane (peers/serving/data_plane_offers.py)
    ReplicaSyncService  commit, state, loading a replica's state, periodic averaging (peers/replicas/)
    StageMoves          rebalancing moves and the standby pool (peers/placement/stage_moves.py)
    Announcer           the DHT record, its renewal, the status file (peers/serving/announcer.py)
    Checkpointer        periodic and final saves (peers/serving/checkpointer.py)
    LinkProber          link measurements for the live planner (peers/placement/link_probe.py)

What several services read and change (the stage served now, which a move swaps; the peer's state;
the request counters) is one `ServingState`. Every RPC the host registers, the stage RPCs, commit,
state, the link probe and the reachability dial-back alike, passes the one `AdmissionGuard`
(peers/serving/admission.py) first; the streamed ones are served on the data plane too
(wire/data_plane.py: direct TLS on the hosts of --host-maddrs, `--data-plane-port`), behind the same
guard, and the peer's own hops to the next stage go over it when it reaches that peer. Compute runs on one dedicated thread (`StageRuntime`);
peers/launch.py builds a host from a `PeerConfig`.
"""

from __future__ import annotations

import asyncio

import hivemind
from hivemind.proto import runtime_pb2

from dht.announce import fetch_stage_records_async
from dht.authority import NO_RUN_WARNING, RunAccess, credential_summary, load_run_access
from dht.reachability import (
    DIAL_BACK_FAILED,
    RPC_REACHABILITY,
    DialBackService,
    ReachabilityReport,
    ReachabilityResponse,
    address_scope,
    check_reachability,
    direct_maddrs,
    verdict,
)
from dht.records import PeerState, SplitRecord
from peers.compute import devices
from peers.compute.compute_thread import ComputeThread
from peers.compute.stage_builder import StageBuilder
from peers.compute.stage_runtime import StageRuntime
from peers.compute.utilization import ComputeClock
from peers.config import PeerConfig
from peers.metrics import PeerMetrics
from peers.placement.link_probe import MAX_PROBE_BYTES, LinkProber, bounded_probe_handler, refused_probe
from peers.placement.split_claim import split_tag
from peers.placement.stage_moves import StageMoves
from peers.replicas.averaging import GradientSync, ParameterAveraging
from peers.replicas.averaging_members import AveragingMembers
from peers.replicas.replica_sync import ReplicaSyncService
from peers.replicas.sync_exchange import SyncExchange
from peers.serving.admission import AdmissionGuard, Rpc
from peers.serving.announcer import Announcer
from peers.serving.chain_rpc import ChainService
from peers.serving.checkpointer import Checkpointer
from peers.serving.data_plane_offers import DataPlaneOffers
from peers.serving.run_follower import RunFollower
from peers.serving.serving_state import ServingState
from peers.serving.stage_rpc import StageRpcService
from process.version import software_version
from wire import compression
from wire.bounded_streams import StreamLimits
from wire.data_plane import DataPlaneClient, DataPlaneServer, direct_host
from wire.protocol import (
    RPC_BACKWARD,
    RPC_CHAIN_PIECE,
    RPC_COMMIT,
    RPC_DATA_PLANE,
    RPC_FORWARD,
    RPC_HOP_RECORD,
    RPC_OUTER_ROUND,
    RPC_PROBE,
    RPC_STATE,
    RPC_SYNC_ROUND,
    RPC_TRAIN_CHAIN,
    ProtocolError,
)
from wire.request_limits import InFlightBytes, PenaltyBox
from wire.transport import Transport
from wire.transport_stats import TransportStats


class PeerHost:
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
        run_access: RunAccess | None = None,
        follower: RunFollower | None = None,
    ):
        """`run_access`: the run's authority and this peer's credential (default: from --run);
        `follower`: the run's spec, which the peer announces and follows to new versions."""
        self.config, self.dht = config, dht
        self.peer_id = dht.peer_id.to_base58()
        self.metrics = metrics = metrics or PeerMetrics()
        self.compute = ComputeThread()  # one thread, backwards before forwards (peers/compute/compute_thread.py)
        self.serving = serving = ServingState(
            runtime, averaging, metrics, compute_clock=ComputeClock(getattr(runtime, "device", None))
        )
        limits = config.serving
        # the run's authority (--run) and this peer's own credential, checked against its identity
        if run_access is None and config.authority.run is not None:
            run_access = load_run_access(config.authority, peer_id=self.peer_id, roles=("peer",))
        self.run_access = run_access
        self.follower = follower
        if follower is not None:  # a new version's schedule: followed by the steps that do not name one
            follower.on_version = lambda spec: serving.runtime.follow_schedule(spec.schedule())
            follower.steps_done = lambda: serving.runtime.steps_done
        credential = run_access.credential.decode() if run_access and run_access.credential else None
        if run_access is None:
            print(f"warning: {NO_RUN_WARNING}", flush=True)
        else:
            run = run_access.authority.run
            print(
                f"run {run.run_id} ({'private' if run.private else 'open'}): "
                + (
                    credential_summary(run_access.held)
                    if run_access.held
                    else "no credential: this peer cannot average with replicas or download state"
                ),
                flush=True,
            )
        self.dial_back = DialBackService()
        self.guard = AdmissionGuard(
            allowed_peers=config.network.allowed_peers,
            max_request_bytes=limits.max_request_bytes,
            penalties=PenaltyBox(burst=limits.bad_request_burst, refill_per_s=limits.bad_request_refill_per_s),
            in_flight=InFlightBytes(
                per_caller_bytes=limits.max_caller_in_flight_bytes,
                total_bytes=limits.max_in_flight_bytes,
                request_deadline_s=limits.request_deadline_s,
            ),
            stream_limits=StreamLimits(read_timeout_s=min(30.0, limits.request_deadline_s)),
            authority=run_access.authority if run_access else None,
        )
        byte_counter = compression.ByteCounter()
        self.stage_rpc = StageRpcService(
            serving,
            self.compute,
            self.guard,
            model=config.model,
            max_concurrent_requests=limits.max_concurrent_requests,
            byte_counter=byte_counter,
            metrics=metrics,
            max_decoded_bytes=limits.max_decoded_bytes,
            peer_id=self.peer_id,
            decoded_budget=InFlightBytes(  # all requests' decoded tensors together, in the same budget's size
                per_caller_bytes=max(limits.max_in_flight_bytes, limits.max_decoded_bytes),
                total_bytes=max(limits.max_in_flight_bytes, limits.max_decoded_bytes),
                request_deadline_s=float(1 << 30),  # no deadline: they are read already
            ),
        )
        self.credential = credential
        self.transport_stats = TransportStats()  # calls and bytes per transport, served and made
        self.offers = DataPlaneOffers(self.guard)  # its server starts with the RPCs (register_rpcs)
        self.data_plane_at = ""  # where it listens
        self.chains = ChainService(  # direct routing: stage to stage
            self.stage_rpc,
            credential=credential,
            record_bytes=int(limits.hop_record_mb * (1 << 20)),
            piece_bytes=limits.hop_piece_kb << 10,
            claim_s=limits.request_deadline_s,
        )
        # a run with an authority: the replicas this one averages with are those holding a peer credential
        self.members = (
            AveragingMembers(
                dht,
                run_access.authority,
                model=config.model,
                peer_id=self.peer_id,
                stage=lambda: serving.runtime.stage,
                averager=lambda: serving.averaging,
                period_s=config.announcing.announce_period_s,
                num_stages=runtime.num_stages,
                recognize=self.guard.recognize if run_access.authority.private else None,
            )
            if run_access is not None
            else None
        )
        self.replicas = ReplicaSyncService(
            serving,
            self.compute,
            dht,
            peer_id=self.peer_id,
            model=config.model,
            averaging_timeout_s=config.replicas.averaging_timeout_s,
            authorize=self.guard.authorize,
            credential=credential,
            members=self.members,
            authority=run_access.authority if run_access else None,
            follower=follower,
        )
        # exact sync by exchange: the builder's (a move keeps it), or the one the given averaging holds
        self.sync_exchange = (
            builder.sync_exchange()
            if builder is not None and builder.named_round_transport(config.replicas) == "exchange"
            else getattr(averaging, "exchange", None)
        )
        self.announcer = Announcer(
            serving,
            dht,
            config.announcing,
            peer_id=self.peer_id,
            model=config.model,
            averaging_mode=config.replicas.averaging,
            metrics=metrics,
            metrics_addr=metrics_addr,
            split=split,
            credential=credential,
            run=follower,
        )
        self.checkpointer = (
            Checkpointer(
                serving,
                self.compute,
                config.checkpointing,
                model=config.model,
                split_tag=split_tag(split, runtime.config.n_layers) if split else None,
                metrics=metrics,
            )
            if config.checkpointing.checkpoint_dir
            else None
        )
        self.moves = (  # builds another stage's runtime when this peer moves
            StageMoves(
                serving,
                self.compute,
                dht,
                config.placement,
                peer_id=self.peer_id,
                model=config.model,
                builder=builder,
                announcer=self.announcer,
                replicas=self.replicas,
                checkpointer=self.checkpointer,
            )
            if builder is not None
            else None
        )
        metrics.watch(
            in_flight=lambda: serving.in_flight,
            throughput=lambda: serving.runtime.throughput.value,
            runtime_counts=lambda: (
                serving.runtime.steps_done,
                serving.runtime.cache_hits,
                serving.runtime.cache_misses,
                serving.runtime.samples_trained,
                serving.runtime.backward_repeats,
            ),
            device_memory_peak=lambda: devices.peak_memory_bytes(serving.runtime.device),
        )
        metrics.watch_compute(
            serving.compute_clock, lambda: {**serving.phases.snapshot(), **serving.runtime.phases.snapshot()}
        )
        metrics.count_bytes(byte_counter.snapshot)
        metrics.count_transports(self.transport_stats.snapshot)
        metrics.set_serving(stage=runtime.stage, num_stages=runtime.num_stages, version=software_version())
        metrics.set_state(serving.state.value)

    # --- the RPCs, each behind the admission guard ----------------------------------------------------
    def rpcs(self) -> list[Rpc]:
        """Every RPC this peer serves, with the answer each gives a refused caller."""
        stage, replicas = self.stage_rpc, self.replicas
        return [
            Rpc(
                RPC_FORWARD,
                stage.rpc_forward,
                stage.refused("forward"),
                stream_input=True,
                stream_output=True,
                carries_credential=True,
            ),
            Rpc(
                RPC_BACKWARD,
                stage.rpc_backward,
                stage.refused("backward"),
                stream_input=True,
                stream_output=True,
                carries_credential=True,
            ),
            Rpc(
                RPC_TRAIN_CHAIN,
                self.chains.rpc_train_chain,
                self.chains.refused,
                stream_input=True,
                stream_output=True,
                carries_credential=True,
            ),
            # The other streams of a chained call in pieces. A piece is authorized by the call that
            # takes it (only the same caller's call does, and only after its own credential passed),
            # so a private run does not refuse it for arriving before the caller was known.
            Rpc(
                RPC_CHAIN_PIECE,
                self.chains.rpc_chain_piece,
                self.chains.refused_piece,
                stream_input=True,
                stream_output=True,
                carries_credential=True,
            ),
            Rpc(
                RPC_HOP_RECORD,
                self.chains.rpc_hop_record,
                self.chains.refused_record,
                stream_output=True,
                carries_credential=True,
            ),
            Rpc(RPC_COMMIT, replicas.rpc_commit, replicas.refused_commit, carries_credential=True),
            Rpc(RPC_STATE, replicas.rpc_state, replicas.refused_state, stream_output=True, carries_credential=True),
            Rpc(
                RPC_OUTER_ROUND,
                replicas.outer.rpc_outer_round,
                replicas.outer.refused,
                stream_input=True,
                stream_output=True,
                carries_credential=True,
            ),
            Rpc(
                RPC_SYNC_ROUND,
                self.rpc_sync_round,
                SyncExchange.refused,
                stream_input=True,
                stream_output=True,
                carries_credential=True,
            ),
            # Other peers measure their link to us (echoes bounded by the probe's own size limit)...
            Rpc(
                RPC_PROBE,
                bounded_probe_handler(),
                refused_probe,
                stream_input=True,
                stream_output=True,
                max_request_bytes=MAX_PROBE_BYTES,
            ),
            # ...and joining peers check that they are reachable.
            Rpc(RPC_REACHABILITY, self.dial_back.rpc_check, _refused_dial_back),
            # Callers ask how to reach the data plane, which serves the streamed RPCs above too.
            Rpc(RPC_DATA_PLANE, self.offers.rpc_offer, self.offers.refused, carries_credential=True),
        ]

    async def register_rpcs(self, p2p) -> None:
        self.chains.p2p = p2p  # a chained call goes on to the next stage's peer
        self.dial_back.p2p = p2p  # it dials back callers only at the hosts their connections come from
        settings, stats = self.config.transport, self.transport_stats
        client = DataPlaneClient(p2p, credential=self.credential, stats=stats) if settings.data_plane else None
        self.chains.transport = Transport(p2p, client, stats=stats)
        rpcs = self.rpcs()
        if settings.data_plane:
            self.offers.server = await self._start_data_plane(p2p, rpcs)
        await self.guard.register(p2p, rpcs, runtime_pb2.ExpertRequest, stats=stats)
        if self.sync_exchange is not None:
            self.sync_exchange.bind(
                loop=asyncio.get_running_loop(),
                transport=self.chains.transport,
                averaging=lambda: self.serving.averaging,
                authorize=self.guard.authorize,
                credential=self.credential,
            )

    async def rpc_sync_round(self, requests, context):
        """RPC_SYNC_ROUND, answered by this peer's exchange (peers/replicas/sync_exchange.py)."""
        exchange = self.sync_exchange
        if exchange is None:
            messages = SyncExchange.refused(ProtocolError("this peer takes no exact sync rounds by exchange"), 0.0)
            for message in messages:
                yield message
            return
        async for message in exchange.rpc_sync_round(requests, context):
            yield message

    async def _start_data_plane(self, p2p, rpcs: list[Rpc]) -> DataPlaneServer | None:
        """The data plane on the hosts this peer's p2pd listens on, or None (said once) when it
        cannot listen there: callers then stay on p2pd."""
        hosts = list(dict.fromkeys(h for h in map(direct_host, self.config.network.host_maddrs) if h is not None))
        server = DataPlaneServer(
            local_id=p2p.peer_id,
            limits=self.guard.stream_limits or StreamLimits(),
            stats=self.transport_stats,
            announce_port=self.config.transport.data_plane_announce_port,
        )
        self.guard.register_data_plane(server, rpcs, runtime_pb2.ExpertRequest)
        try:
            if not hosts:
                raise OSError(f"no IP host in --host-maddrs {' '.join(self.config.network.host_maddrs)}")
            port = await server.start(hosts, self.config.transport.data_plane_port)
        except OSError as e:
            print(f"data plane off: cannot listen ({e}); calls stay on p2pd", flush=True)
            return None
        self.data_plane_at = f"{', '.join(hosts)} port {port}"
        return server

    # --- lifecycle ---------------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event, alone: asyncio.Event | None = None) -> None:
        """Register the RPCs, join (standby, or loading a replica's state), serve until `stop`, then leave.
        `alone`: set when the process that started this peer is gone (process/lifetime.py): its swarm
        is going down with it, so the peer then stops at once, keeping only its checkpoint."""
        config, serving = self.config, self.serving
        self.alone = alone or asyncio.Event()
        p2p = await self.dht.replicate_p2p()
        await self.register_rpcs(p2p)
        if config.placement.standby:  # backup pool: wait, holding a copy of a stage, until one needs us
            if not await self.moves.stand_by(p2p, stop):
                await self._leave_standby()
                return
        elif config.replicas.load_state:
            await self.announcer.announce()  # joining: trainers do not route here yet
            await self.replicas.load_state_from_replica(p2p)
        serving.set_state(PeerState.ONLINE)
        announcer = asyncio.create_task(self.announcer.run(stop))
        rebalancer = (
            asyncio.create_task(self.moves.rebalance_forever(p2p, stop))
            if config.placement.rebalance_period_s > 0 and self.moves is not None
            else None
        )
        checkpointer = asyncio.create_task(self.checkpointer.run(stop)) if self.checkpointer is not None else None
        members = asyncio.create_task(self.members.run(stop)) if self.members is not None else None
        following = asyncio.create_task(self.follower.run(stop)) if self.follower is not None else None
        averaging = serving.averaging
        averager = (  # by steps, rounds follow the trainer's commits (rpc_commit)
            asyncio.create_task(self.replicas.average_parameters_forever(stop))
            if isinstance(averaging, ParameterAveraging) and not averaging.rounds_schedule.by_steps
            else None
        )
        probe = config.probing.probe
        prober = (  # our links to others, for `swarm plan --from-dht`
            asyncio.create_task(self._link_prober(p2p, probe).run(stop)) if probe is not None else None
        )
        reachability = (
            asyncio.create_task(self._report_reachability(p2p))
            if config.announcing.reachability_check != "off"
            else None
        )
        print(
            f"peer {self.peer_id} online: {config.model} stage {serving.runtime.stage}/{serving.runtime.num_stages} "
            f"({serving.runtime.throughput.value:.1f} samples/s measured)"
            + (f", data plane on {self.data_plane_at}" if self.offers.server is not None else ""),
            flush=True,
        )
        try:
            await stop.wait()
        finally:
            await self._stop_in_order(
                rebalancer, reachability, announcer, prober, members, averager, checkpointer, following
            )

    async def _stop_in_order(
        self, rebalancer, reachability, announcer, prober, members, averager, checkpointer, following=None
    ) -> None:
        """The one way a serving peer stops: what it holds first (a move under way finishes, then the
        checkpoint is saved), then what others read (offline on the DHT, the split released); the
        launcher stops the DHT node last. A DHT write that cannot complete (p2pd gone) costs its
        timeout, never the checkpoint. Once `alone` is set (the parent died), every step but the
        checkpoint is cut short: the swarm is going down, and its bootstrap node with it."""
        serving = self.serving
        if rebalancer is not None:  # a move under way finishes first, so that offline is the last word
            await self._unless_alone(rebalancer)
        if serving.averaging is not None:  # a round under way would hold the checkpoint up to its timeout
            serving.averaging.close()
        if reachability is not None:
            reachability.cancel()
            await asyncio.gather(reachability, return_exceptions=True)
        if checkpointer is not None:  # never cut short: the one thing that must outlive the peer
            await checkpointer
            await self.checkpointer.save_now()
            print(f"checkpoint saved to {self.checkpointer.path()}", flush=True)
        serving.set_state(PeerState.OFFLINE)
        for task in (announcer, prober, members, following):
            if task is not None:
                await self._unless_alone(task)
        await self._unless_alone(self.announcer.announce_final())
        if averager is not None:
            await self._unless_alone(averager)
        await self._unless_alone(self.announcer.release_split())
        if self.chains.transport is not None:  # the next stage's handlers end now, not at their idle timeout
            self.chains.transport.close()
        if self.offers.server is not None:
            await self.offers.server.stop()
        if self.alone.is_set():
            print(
                f"peer {self.peer_id} stopped after serving {serving.requests_served} requests, without announcing "
                f"offline (the process that started it is gone; its record expires within "
                f"{self.announcer.ttl_s:.0f} s)",
                flush=True,
            )
        else:
            print(f"peer {self.peer_id} offline after serving {serving.requests_served} requests", flush=True)
        self._release_compute()

    async def _unless_alone(self, awaitable) -> None:
        """Await a step of the stop, or cancel it as soon as `alone` is set (at once if it already is)."""
        task = asyncio.ensure_future(awaitable)
        alone = asyncio.ensure_future(self.alone.wait())
        try:
            await asyncio.wait({task, alone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            alone.cancel()
        if task.done():
            task.result()  # a step that failed on its own says so, as before
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _leave_standby(self) -> None:
        """Stopped while on standby: say so on the DHT and release the compute thread and averager."""
        self.serving.set_state(PeerState.OFFLINE)
        await self._unless_alone(self.announcer.announce(timeout_s=5.0))
        print(f"peer {self.peer_id} offline after standing by", flush=True)
        self._release_compute()

    def _release_compute(self) -> None:
        self.compute.shutdown(wait=False, cancel_futures=True)
        if self.serving.averaging is not None:
            self.serving.averaging.shutdown()

    def _link_prober(self, p2p, settings) -> LinkProber:
        serving = self.serving
        return LinkProber(
            self.dht,
            p2p,
            peer_id=self.peer_id,
            model=self.config.model,
            num_stages=serving.runtime.num_stages,
            stage=lambda: serving.runtime.stage,
            throughput=lambda: serving.runtime.throughput.value,
            settings=settings,
        )

    async def _report_reachability(self, p2p) -> None:
        """Ask a few online peers of this model to dial this one back, and print the verdict."""
        use_auto_relay = self.config.network.use_auto_relay
        maddrs = direct_maddrs(str(m) for m in await p2p.get_visible_maddrs())
        if self.config.announcing.reachability_check == "auto" and all(address_scope(m) == "loopback" for m in maddrs):
            report = ReachabilityReport(tuple(maddrs), asked=0, reachable_by=0)
            print(verdict(report, use_auto_relay=use_auto_relay), flush=True)
            return
        helpers = set()
        for stage in range(self.serving.runtime.num_stages):
            records = await fetch_stage_records_async(self.dht, self.config.model, stage)
            helpers |= {r.peer_id for r in records if r.state == PeerState.ONLINE and r.peer_id != self.peer_id}
        report = await check_reachability(p2p, helpers, maddrs=maddrs)
        print(verdict(report, use_auto_relay=use_auto_relay), flush=True)


def _refused_dial_back(error: Exception, waited_s: float) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(
        metadata=ReachabilityResponse(reachable=False, error=DIAL_BACK_FAILED).model_dump_json().encode()
    )
