"""The peer server: hosts one stage over hivemind's P2P and keeps its DHT record fresh.

Async code lives here and nowhere else on the peer: the RPC handlers decode requests on the event
loop, hand compute to one dedicated thread (`StageRuntime`), and stream answers back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import hivemind
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from dht.announce import announce, fetch_stage_records_async
from dht.node import start_dht
from dht.records import PeerRecord, PeerState, SplitRecord
from dht.split_agreement import publish_split_async
from models.config import get_model_config
from peers.averaging import GradientSync, ParameterAveraging
from peers.checkpoint import CheckpointError, checkpoint_path
from peers.config import PeerConfig
from peers.faults import FaultSettings, FaultyStageRuntime
from peers.metrics import PeerMetrics, advertised_metrics_addr, serve_metrics
from peers.health import write_status
from peers.protocol import (RPC_BACKWARD, RPC_COMMIT, RPC_FORWARD, RPC_STATE, CommitRequest, CommitResponse, ErrorKind,
                            ProtocolError, RequestHeader, ResponseHeader, StateHeader, StateRequest, decode_header,
                            decode_tensors, encode_header, encode_tensor, from_wire, read_stream, response_messages,
                            to_wire)
from peers.state_transfer import download_state, state_messages
from peers.split_claim import claim_split, renewed, split_tag
from swarm import compression
from peers.stage_runtime import BadRequestError, OptimizerSettings, StageRuntime

logger = logging.getLogger(__name__)


def software_version() -> str:
    try:
        return metadata.version("swarm-train")
    except metadata.PackageNotFoundError:
        return "dev"


class PeerServer:
    def __init__(self, config: PeerConfig, runtime: StageRuntime, dht: hivemind.DHT,
                 averaging: GradientSync | ParameterAveraging | None = None, *,
                 metrics: PeerMetrics | None = None, metrics_addr: str | None = None, split: SplitRecord | None = None):
        self.config, self.runtime, self.dht = config, runtime, dht
        self.averaging = averaging
        self.metrics, self.metrics_addr = metrics or PeerMetrics(), metrics_addr
        self.split, self.split_tag = split, split_tag(split, runtime.config.n_layers) if split else None
        self.peer_id = dht.peer_id.to_base58()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self.in_flight = 0
        self.requests_served = 0
        self.requests_failed = 0
        self.state = PeerState.JOINING
        self.online_since = time.monotonic()
        self.announced_online_at: float | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self.bytes = compression.ByteCounter()
        self.feedback = compression.ErrorFeedback()
        self.metrics.watch(in_flight=lambda: self.in_flight, throughput=lambda: self.runtime.throughput.value,
                           runtime_counts=lambda: (self.runtime.steps_done, self.runtime.cache_hits,
                                                   self.runtime.cache_misses))
        self.metrics.count_bytes(self.bytes.snapshot)
        self.metrics.set_serving(stage=runtime.stage, num_stages=runtime.num_stages, version=software_version())
        self.metrics.set_state(self.state.value)

    # --- DHT record ------------------------------------------------------------------------------
    def record(self) -> PeerRecord:
        return PeerRecord(peer_id=self.peer_id, model=self.config.model, stage=self.runtime.stage,
                          num_stages=self.runtime.num_stages, state=self.state,
                          throughput=float(self.runtime.throughput.value), load=float(self.in_flight),
                          version=software_version(), expires_at=get_dht_time() + self.config.record_ttl_s,
                          averaging=self.config.averaging, metrics_addr=self.metrics_addr)

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
            except asyncio.TimeoutError:
                pass

    def _report_status(self, announced: bool) -> None:
        """With --status-file: what `python -m peers.health` (the container's HEALTHCHECK) reads."""
        if self.config.status_file:
            write_status(self.config.status_file, self.record(), announced=announced, ttl_s=self.config.record_ttl_s,
                         requests_served=self.requests_served, requests_failed=self.requests_failed)

    # --- RPC handlers ----------------------------------------------------------------------------
    async def rpc_forward(self, requests, context):
        async for message in self._serve("forward", requests):
            yield message

    async def rpc_backward(self, requests, context):
        async for message in self._serve("backward", requests):
            yield message

    async def _serve(self, rpc: str, requests):
        received = time.perf_counter()
        self.in_flight += 1
        failure_kind, queue_s, compute_s, samples = None, None, None, 0
        try:
            header, parts = await read_stream(requests, RequestHeader)
            if header.rpc != rpc:
                raise ProtocolError(f"a {header.rpc!r} header was sent to the {rpc!r} handler")
            self._check_route(header)
            if header.response_codec not in compression.known_codecs():
                raise ProtocolError(f"unknown response codec {header.response_codec!r}; this peer knows "
                                    f"{', '.join(compression.known_codecs())}")
            encoded = from_wire(header.tensors, parts)
            for item in encoded.values():
                self.bytes.record_received(item)
            tensors = decode_tensors(encoded)
            async with self._semaphore:
                queued = time.perf_counter()
                outputs, loss = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self._compute, header, tensors)
            compute_s, queue_s, samples = time.perf_counter() - queued, queued - received, header.batch_size
            encoded_outputs = [(name, self._encode_output(name, tensor, header)) for name, tensor in outputs]
            for _, item in encoded_outputs:
                self.bytes.record_sent(item)
            metas, out_parts = to_wire(encoded_outputs)
            response = ResponseHeader(tensors=metas, loss=loss, compute_s=compute_s, queue_s=queued - received)
            self.requests_served += 1
            if self.requests_served == 1 and self.announced_online_at is not None:
                print(f"first request served {time.monotonic() - self.announced_online_at:.2f} s after the "
                      f"online record was stored", flush=True)
        except (ProtocolError, BadRequestError) as e:
            self.requests_failed += 1
            kind = failure_kind = ErrorKind.WRONG_STAGE if isinstance(e, _WrongStageError) else ErrorKind.BAD_REQUEST
            logger.warning(f"Refused a {rpc} request: {e}")
            response, out_parts = ResponseHeader(error=str(e), error_kind=kind), []
        except Exception as e:  # a bug or resource failure here must not take the peer down
            self.requests_failed += 1
            logger.exception(f"{rpc} failed")
            failure_kind = ErrorKind.INTERNAL
            response, out_parts = ResponseHeader(error=f"{type(e).__name__}: {e}", error_kind=ErrorKind.INTERNAL), []
        finally:
            self.in_flight -= 1
            self.metrics.observe_request(stage=self.runtime.stage, rpc=rpc, duration_s=time.perf_counter() - received,
                                         samples=samples, queue_s=queue_s, compute_s=compute_s,
                                         failure_kind=failure_kind.value if failure_kind else None)
        for message in response_messages(response, out_parts):
            yield message

    def _encode_output(self, name: str, tensor: torch.Tensor, header: RequestHeader) -> compression.EncodedTensor:
        """Encode with the codec the caller asked for; top-k gradients keep an error-feedback residual."""
        feedback = self.feedback if name == "grad_inputs" and header.response_codec == "topk" else None
        return encode_tensor(tensor, header.response_codec, header.response_codec_params, feedback=feedback,
                             feedback_key=name)

    def _check_route(self, header: RequestHeader) -> None:
        if header.model != self.config.model or header.num_stages != self.runtime.num_stages:
            raise ProtocolError(f"this peer serves {self.config.model} split into {self.runtime.num_stages} "
                                f"stages, not {header.model} in {header.num_stages}")
        if header.stage != self.runtime.stage:
            raise _WrongStageError(f"this peer serves stage {self.runtime.stage}, not stage {header.stage}")

    def _compute(self, header: RequestHeader, tensors: dict[str, torch.Tensor]):
        """Runs on the compute thread."""
        inputs = tensors.get("inputs")
        if inputs is None:
            raise BadRequestError("the request carries no 'inputs' tensor")
        if inputs.shape[:1] != (header.batch_size,):
            raise BadRequestError(f"batch_size says {header.batch_size}, inputs have shape {tuple(inputs.shape)}")
        if header.rpc == "forward":
            outputs = self.runtime.forward(header.microbatch_id, inputs, tensors.get("targets"))
            if self.runtime.is_last:
                return [], float(outputs)
            return [("outputs", outputs)], None
        grad_inputs, loss = self.runtime.backward(header.microbatch_id, inputs, grad_outputs=tensors.get("grad_outputs"),
                                                  targets=tensors.get("targets"))
        return ([("grad_inputs", grad_inputs)] if grad_inputs is not None else []), loss

    # --- averaging and state transfer ---------------------------------------------------------------
    async def rpc_commit(self, request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        """Sync averaging: the trainer finished a step; average gradients with the other replicas and step."""
        try:
            commit = decode_header(CommitRequest, request.metadata)
            if (commit.model, commit.stage, commit.num_stages) != (self.config.model, self.runtime.stage,
                                                                   self.runtime.num_stages):
                raise ProtocolError(f"this peer serves {self.config.model} stage {self.runtime.stage}/"
                                    f"{self.runtime.num_stages}")
            if not isinstance(self.averaging, GradientSync):
                response = CommitResponse(steps_done=self.runtime.steps_done)  # not in sync mode: nothing to do
            else:
                outcome = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.averaging.commit, commit.step_id, commit.group_size)
                response = CommitResponse(stepped=outcome.stepped, averaged=outcome.averaged,
                                          group_size=outcome.group_size, samples=outcome.samples,
                                          steps_done=self.runtime.steps_done)
        except ProtocolError as e:
            response = CommitResponse(error=str(e))
        return runtime_pb2.ExpertResponse(metadata=encode_header(response))

    async def rpc_state(self, request: runtime_pb2.ExpertRequest, context):
        """Stream this stage's parameters and optimizer state to a joining replica."""
        try:
            wanted = decode_header(StateRequest, request.metadata)
            if (wanted.model, wanted.stage, wanted.num_stages) != (self.config.model, self.runtime.stage,
                                                                   self.runtime.num_stages):
                raise ProtocolError(f"this peer serves {self.config.model} stage {self.runtime.stage}/"
                                    f"{self.runtime.num_stages}")
            data = await asyncio.get_running_loop().run_in_executor(self.executor, self.runtime.export_state,
                                                                    self.config.model)
            header = StateHeader(total_bytes=len(data), steps_done=self.runtime.steps_done)
        except ProtocolError as e:
            header, data = StateHeader(error=str(e)), b""
        for message in state_messages(header, data):
            yield message

    async def _load_state_from_replica(self, p2p) -> None:
        """Before going online: copy the stage's current state from a live replica, if there is one."""
        records = [r for r in await fetch_stage_records_async(self.dht, self.config.model, self.runtime.stage)
                   if r.state == PeerState.ONLINE and r.peer_id != self.peer_id
                   and r.num_stages == self.runtime.num_stages]
        request = StateRequest(model=self.config.model, stage=self.runtime.stage, num_stages=self.runtime.num_stages)
        for record in sorted(records, key=lambda r: r.load):
            try:
                state = await download_state(p2p, record.peer_id, request, timeout_s=self.config.averaging_timeout_s * 4)
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.runtime.import_state, state, self.config.model,
                    f"state from replica {record.peer_id[-8:]}")
                print(f"loaded stage {self.runtime.stage} state from replica {record.peer_id[-8:]} "
                      f"({self.runtime.steps_done} steps done)", flush=True)
                return
            except (CheckpointError, ProtocolError, asyncio.TimeoutError, OSError) as e:
                logger.warning(f"Could not load state from {record.peer_id[-8:]}: {e}; trying another replica")
            except Exception as e:  # the replica may vanish mid-transfer in many ways
                logger.warning(f"Could not load state from {record.peer_id[-8:]}: {type(e).__name__}: {e}")
        if records:
            print(f"no replica of stage {self.runtime.stage} could send its state; starting from what we have",
                  flush=True)

    async def _average_parameters_forever(self, stop: asyncio.Event) -> None:
        """Periodic mode: meet the other replicas at every multiple of the period (DHT time)."""
        while not stop.is_set():
            round_time = self.averaging.next_round_time()
            delay = max(round_time - get_dht_time() - 1.0, 0.0)  # join matchmaking a second early
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
                return
            except asyncio.TimeoutError:
                pass
            records = await fetch_stage_records_async(self.dht, self.config.model, self.runtime.stage)
            group = [r for r in records if r.state == PeerState.ONLINE and r.averaging == "periodic"
                     and r.num_stages == self.runtime.num_stages]
            group_size = len({r.peer_id for r in group} | {self.peer_id})
            outcome = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.averaging.average, group_size, round_time)
            if outcome.averaged:
                print(f"averaged parameters with {outcome.group_size - 1} other replica(s) "
                      f"(round {self.averaging.rounds})", flush=True)
            await asyncio.sleep(1.0)

    # --- checkpoints -----------------------------------------------------------------------------
    def checkpoint_file(self) -> str:
        return checkpoint_path(self.config.checkpoint_dir, self.config.model, self.runtime.stage, self.runtime.num_stages,
                               self.split_tag)

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
            except asyncio.TimeoutError:
                await asyncio.get_running_loop().run_in_executor(self.executor, self.save_checkpoint)

    # --- lifecycle -------------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event) -> None:
        self._semaphore = asyncio.Semaphore(self.config.max_concurrent_requests)
        p2p = await self.dht.replicate_p2p()
        await p2p.add_protobuf_handler(RPC_FORWARD, self.rpc_forward, runtime_pb2.ExpertRequest,
                                       stream_input=True, stream_output=True)
        await p2p.add_protobuf_handler(RPC_BACKWARD, self.rpc_backward, runtime_pb2.ExpertRequest,
                                       stream_input=True, stream_output=True)
        await p2p.add_protobuf_handler(RPC_COMMIT, self.rpc_commit, runtime_pb2.ExpertRequest)
        await p2p.add_protobuf_handler(RPC_STATE, self.rpc_state, runtime_pb2.ExpertRequest, stream_output=True)
        if self.config.load_state:
            await announce(self.dht, self.record())  # joining: trainers do not route here yet
            await self._load_state_from_replica(p2p)
        self.state = PeerState.ONLINE
        self.metrics.set_state(self.state.value)
        self.online_since = time.monotonic()
        announcer = asyncio.create_task(self._announce_forever(stop))
        checkpointer = asyncio.create_task(self._checkpoint_forever(stop)) if self.config.checkpoint_dir else None
        averager = (asyncio.create_task(self._average_parameters_forever(stop))
                    if isinstance(self.averaging, ParameterAveraging) else None)
        print(f"peer {self.peer_id} online: {self.config.model} stage {self.runtime.stage}/{self.runtime.num_stages} "
              f"({self.runtime.throughput.value:.1f} samples/s measured)", flush=True)
        try:
            await stop.wait()
        finally:
            self.state = PeerState.OFFLINE
            self.metrics.set_state(self.state.value)
            await announcer
            self._report_status(await announce(self.dht, self.record(), timeout_s=5.0))
            if averager is not None:
                await averager
            if self.split is not None:  # our claim on the split no longer binds anyone
                await publish_split_async(self.dht, renewed(self.split, active=False, ttl_s=self.config.record_ttl_s),
                                          timeout_s=5.0)
            if checkpointer is not None:
                await checkpointer
                await asyncio.get_running_loop().run_in_executor(self.executor, self.save_checkpoint)
            print(f"peer {self.peer_id} offline after serving {self.requests_served} requests", flush=True)
            self.executor.shutdown(wait=False, cancel_futures=True)
            if self.averaging is not None:
                self.averaging.shutdown()


class _WrongStageError(ProtocolError):
    pass


def run_peer(config: PeerConfig) -> None:
    """Start the DHT node, measure the stage, serve until SIGINT/SIGTERM, then announce offline."""
    torch.set_num_threads(config.num_threads)
    model_config = get_model_config(config.model)
    settings = OptimizerSettings(lr=config.lr, weight_decay=config.weight_decay,
                                 target_batch_size=config.target_batch_size, kind=config.optimizer)
    metrics = PeerMetrics()
    endpoint = serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)  # before the DHT: fails fast
    metrics_addr = endpoint and advertised_metrics_addr(endpoint.host, endpoint.port, host_maddrs=config.host_maddrs,
                                                        announce_maddrs=config.announce_maddrs)
    if endpoint:
        print(f"metrics on {endpoint.url} (announced as {metrics_addr or 'nothing: no reachable address known'})",
              flush=True)
    dht = start_dht(config)
    try:
        # The split is agreed on the DHT before the stage is built: a peer whose split disagrees
        # with the swarm's stops here with a SplitConflictError.
        split = claim_split(dht, model=config.model, peer_id=dht.peer_id.to_base58(),
                            requested=config.requested_boundaries, num_stages=config.num_stages,
                            n_layers=model_config.n_layers, ttl_s=config.record_ttl_s)
        runtime = StageRuntime(model_config, config.stage, config.num_stages, seed=config.seed, optimizer=settings,
                               max_batch_size=config.max_batch_size, activation_cache_size=config.activation_cache_size,
                               boundaries=split.boundaries)
        if config.checkpoint_dir:
            path = checkpoint_path(config.checkpoint_dir, config.model, config.stage, config.num_stages,
                                   split_tag(split, model_config.n_layers))
            if os.path.exists(path):
                runtime.restore(path, config.model)
                print(f"restored stage {config.stage} from {path} ({runtime.steps_done} steps done)", flush=True)
        runtime.measure_throughput()
        stage_runtime = runtime
        faults = FaultSettings(slowdown=config.fault_slowdown, fail_rate=config.fault_fail_rate, seed=config.seed)
        if faults.enabled:
            print(f"fault injection on: {faults}", flush=True)
            runtime = FaultyStageRuntime(runtime, faults)
        compression.BlockwiseInt8Codec.warm_up()  # bitsandbytes loads its kernels on first use (~1-2 s)
        averaging = None
        if config.averaging == "sync":
            averaging = GradientSync(stage_runtime, dht, config.model, timeout_s=config.averaging_timeout_s,
                                     compression=config.averaging_compression or "none")
        elif config.averaging == "periodic":
            averaging = ParameterAveraging(stage_runtime, dht, config.model, period_s=config.averaging_period_s,
                                           timeout_s=config.averaging_timeout_s,
                                           compression=config.averaging_compression or "none")
        asyncio.run(_serve_until_signalled(PeerServer(config, runtime, dht, averaging, metrics=metrics,
                                                      metrics_addr=metrics_addr, split=split)))
    finally:
        dht.shutdown()
        if endpoint:
            endpoint.close()


async def _serve_until_signalled(server: PeerServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.serve(stop)
