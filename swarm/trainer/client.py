"""Calling one peer: a typed stub over hivemind's P2P with a timeout on every call.

Each call builds its request with one `wire.messages` call and reads the answer with one; a failed
call raises `PeerCallError` with a `wire.failures.Failure` saying why (timeout, transport, garbage,
or the peer's own answer as `caller_failure` classifies it). The streamed calls (forward, backward,
train_chain, hop_record) go over the peer's data plane when it reaches this process, else over
p2pd (`wire.transport.Transport`); a connection that breaks mid-call is a transport failure either way.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from process.phase_times import PhaseTimes
from wire.bounded_streams import StreamLimits
from wire.compression import ByteCounter, CodecChoice, EncodedTensor
from wire.data_plane import DataPlaneClient
from wire.failures import Failure, caller_failure
from wire.messages import Received, read_response, read_unary, unary_request, write_request
from wire.protocol import (
    HOP_RECORD_NAMES,
    RPC_BACKWARD,
    RPC_COMMIT,
    RPC_FORWARD,
    RPC_HOP_RECORD,
    RPC_TRAIN_CHAIN,
    ChainRequest,
    ChainResponse,
    CommitRequest,
    CommitResponse,
    ComputeBusy,
    FollowsCommit,
    HopFailover,
    HopRecordRequest,
    ProtocolError,
    RequestHeader,
    ResponseHeader,
    StreamClosedError,
)
from wire.tensors import decode_tensors
from wire.transport import Transport


@dataclass(frozen=True)
class CallResult:
    outputs: dict[str, torch.Tensor]  # decoded
    received: dict[str, EncodedTensor]  # the same tensors as they came over the wire (to pass on as they are)
    response: ResponseHeader
    moved: int  # payload bytes, both ways


class PeerCallError(RuntimeError):
    def __init__(self, peer_id: str, kind: Failure, message: str):
        super().__init__(f"peer {peer_id[-8:]}: {kind.value}: {message}")
        self.peer_id, self.kind = peer_id, kind


class ChainCallError(PeerCallError):
    """A chained call failed: `stage` is the stage whose call failed, `failed_peers` the replicas of
    it that were tried (the one called, when the call to the first stage itself failed), `failovers`
    each hop inside the chain that failed on the way, and how (as the peers before them said)."""

    def __init__(
        self,
        peer_id: str,
        kind: Failure,
        message: str,
        *,
        stage: int,
        failed_peers: list[str],
        failovers: list[HopFailover] | None = None,
    ):
        super().__init__(peer_id, kind, message)
        self.stage, self.failed_peers, self.failovers = stage, failed_peers, failovers or []


@dataclass(frozen=True)
class ChainResult:
    loss: float
    served_by: list[str]  # the peer that served each stage
    failed_over: list[HopFailover]  # replicas a hop failed on before another of their stage answered, and how
    moved: int  # payload bytes, both ways
    busy: list[ComputeBusy] = field(default_factory=list)  # each served_by peer's compute clock, as stated
    grad_samples: list[list[float]] = field(default_factory=list)  # each stage's gradient sample (keep_records)
    samples_problem: str | None = None  # ... why they are not the ones owed (ChainResponse.samples_problem)
    steps_done: list[int] = field(default_factory=list)  # the steps each stage's parameters had taken, as stated


class StageClient:
    def __init__(
        self, p2p: P2P, *, model: str, num_stages: int, credential: str | None = None, data_plane: bool = True
    ):
        """`credential`: this trainer's run credential (dht/authority.py), sent in every request header;
        `data_plane`: call peers over their data plane when it reaches them (else p2pd only)."""
        self.p2p, self.model, self.num_stages = p2p, model, num_stages
        self.credential = credential
        self.spec_version = 0  # the version of the run's spec each commit names (swarm/trainer/settle.py)
        # the commit still travelling that every call now follows (swarm/trainer/schedule.py sets it)
        self.follows_commit: FollowsCommit | None = None
        self.bytes = ByteCounter()
        # the data plane's connections or p2pd's streams to the peers, kept open from call to call
        self.phases = PhaseTimes()  # the trainer's phases (swarm/trainer/metrics.py, TRAINER_PHASES)
        self.transport = Transport(p2p, DataPlaneClient(p2p, credential=credential) if data_plane else None)

    def close(self) -> None:
        """Close the kept connections and streams (the peers' handlers of them end now, not when idle)."""
        self.transport.close()

    async def call(
        self,
        peer_id: str,
        *,
        rpc: str,
        stage: int,
        microbatch_id: str,
        batch_size: int,
        tensors: list[tuple[str, EncodedTensor]],
        timeout_s: float,
        response_codec: CodecChoice = CodecChoice("none"),
    ) -> tuple[dict[str, torch.Tensor], ResponseHeader, int]:
        """Returns the decoded outputs, the peer's response header, and the payload bytes moved both ways."""
        result = await self.exchange(
            peer_id,
            rpc=rpc,
            stage=stage,
            microbatch_id=microbatch_id,
            batch_size=batch_size,
            tensors=tensors,
            timeout_s=timeout_s,
            response_codec=response_codec,
        )
        return result.outputs, result.response, result.moved

    async def exchange(
        self,
        peer_id: str,
        *,
        rpc: str,
        stage: int,
        microbatch_id: str,
        batch_size: int,
        tensors: list[tuple[str, EncodedTensor]],
        timeout_s: float,
        response_codec: CodecChoice = CodecChoice("none"),
        inputs_cached: bool = False,
        evaluate: bool = False,
        max_answer_bytes: int | None = None,
        grad_sample: bool = False,
        check_precision: str | None = None,
    ) -> CallResult:
        """One forward or backward call. `inputs_cached` (backward): no inputs are sent, the peer
        reuses those of its forward, or fails with Failure.CACHE_MISS. `max_answer_bytes`: an answer
        whose tensors would decode to more is garbage, refused at its header (a malicious replica's
        top-k header may declare a gigabyte in a few bytes). `grad_sample` (backward): the answer
        carries the sample of its parameter gradient; `check_precision`: a spot check's recompute in
        that precision (nothing kept on the peer)."""
        request = write_request(
            RequestHeader(
                rpc=rpc,
                model=self.model,
                stage=stage,
                num_stages=self.num_stages,
                microbatch_id=microbatch_id,
                batch_size=batch_size,
                response_codec=response_codec.codec,
                response_codec_params=response_codec.params,
                inputs_cached=inputs_cached,
                evaluate=evaluate,
                credential=self.credential,
                grad_sample=grad_sample,
                check=check_precision is not None,
                check_precision=check_precision or "fp32",
                follows_commit=self.follows_commit,
            ),
            tensors,
        )
        name = RPC_FORWARD if rpc == "forward" else RPC_BACKWARD
        answer = await self._answer(peer_id, name, request, max_answer_bytes, timeout_s, f"{rpc} on stage {stage}")
        response = answer.header
        if response.error is not None:
            raise PeerCallError(peer_id, caller_failure(response.error_kind), response.error)
        try:
            encoded = answer.encoded()
            with self.phases.timed("decode"):
                outputs = decode_tensors(encoded, max_bytes=max_answer_bytes)
        except ProtocolError as e:
            raise PeerCallError(peer_id, Failure.GARBAGE, str(e)) from None
        for _, item in tensors:
            self.bytes.record_sent(item)
        for item in encoded.values():
            self.bytes.record_received(item)
        moved = sum(item.nbytes for _, item in tensors) + sum(item.nbytes for item in encoded.values())
        return CallResult(outputs, encoded, response, moved)

    async def hop_record(
        self, peer_id: str, *, stage: int, microbatch_id: str, side: str, timeout_s: float, max_answer_bytes: int
    ) -> tuple[EncodedTensor, torch.Tensor]:
        """Direct routing's spot checks: what `peer_id`, serving `stage`, `side` (received, sent,
        grad_received, grad_sent) for `microbatch_id` in a chain this trainer drove, as it crossed
        the wire (peers/serving/hop_records.py), and decoded (within `max_answer_bytes`). Raises
        PeerCallError."""
        header = HopRecordRequest(
            model=self.model,
            stage=stage,
            num_stages=self.num_stages,
            microbatch_id=microbatch_id,
            side=side,
            credential=self.credential,
        )
        answer = await self._answer(
            peer_id, RPC_HOP_RECORD, write_request(header), max_answer_bytes, timeout_s, f"the {side} record"
        )
        if answer.header.error is not None:
            raise PeerCallError(peer_id, caller_failure(answer.header.error_kind), answer.header.error)
        name = HOP_RECORD_NAMES[side]
        try:
            tensor = answer.encoded().get(name)
            if tensor is None:
                raise ProtocolError(f"the answer carries no {name!r}")
            decoded = decode_tensors({name: tensor}, max_bytes=max_answer_bytes)[name]
        except ProtocolError as e:
            raise PeerCallError(peer_id, Failure.GARBAGE, str(e)) from None
        self.bytes.record_received(tensor)
        return tensor, decoded

    async def train_chain(
        self,
        peer_id: str,
        *,
        microbatch_id: str,
        batch_size: int,
        tensors: list[tuple[str, EncodedTensor]],
        route: list[list[str]],
        timeout_s: float,
        trainer_id: str,
        stage: int = 0,
        codec: str = "none",
        topk_fraction: float = 0.1,
        loss_budget: float | None = None,
        keep_records: bool = False,
    ) -> ChainResult:
        """Direct routing: one microbatch's training pass, sent to `peer_id` (a stage-0 replica), which
        passes it on stage to stage along `route` (candidates for stages 1..S-1; `stage`: another first
        stage, which a peer refuses from anyone but a peer of the stage before). Raises
        ChainCallError on failure (which stage, which of its replicas were tried). `codec`: the run's
        codec (or "adaptive"), which each peer applies to the hop it sends; `loss_budget`: what its
        adaptive choices may cost (None: no budget); `keep_records`: the peers keep what crosses each hop for
        this trainer's spot checks."""
        request = write_request(
            ChainRequest(
                model=self.model,
                stage=stage,
                num_stages=self.num_stages,
                microbatch_id=microbatch_id,
                batch_size=batch_size,
                route=route,
                timeout_s=float(timeout_s),
                trainer_id=trainer_id,
                credential=self.credential,
                codec=codec,
                topk_fraction=topk_fraction,
                loss_budget=loss_budget,
                keep_records=keep_records,
                follows_commit=self.follows_commit,
            ),
            tensors,
        )

        def failed(kind: Failure, message: str) -> ChainCallError:
            return ChainCallError(peer_id, kind, message, stage=stage, failed_peers=[peer_id])

        try:
            limits = StreamLimits(read_timeout_s=timeout_s + 5.0)
            answer = await asyncio.wait_for(self._read_chain(peer_id, request, limits), timeout=timeout_s)
        except TimeoutError:
            raise failed(Failure.TIMEOUT, f"the chained call took over {timeout_s:.1f} s") from None
        except StreamClosedError as e:
            raise failed(Failure.TRANSPORT, str(e)) from None
        except ProtocolError as e:
            raise failed(Failure.GARBAGE, str(e)) from None
        except Exception as e:  # hivemind raises assorted errors for dead or unreachable peers
            raise failed(Failure.TRANSPORT, f"{type(e).__name__}: {e}") from None
        response = answer.header
        if response.error is not None:
            own = response.failed_stage is None  # the peer called failed, not a stage after it
            failed_stage = stage if own else response.failed_stage
            raise ChainCallError(
                peer_id,
                caller_failure(response.error_kind),
                f"stage {failed_stage}: {response.error}",
                stage=failed_stage,
                failed_peers=[peer_id] if own else list(response.failed_peers),
                failovers=list(response.failed_over),
            )
        if response.loss is None or not math.isfinite(response.loss) or answer.parts:
            raise failed(Failure.GARBAGE, f"expected a finite loss and no tensor, got loss {response.loss}")
        for _, item in tensors:
            self.bytes.record_sent(item)
        moved = sum(item.nbytes for _, item in tensors)
        return ChainResult(
            float(response.loss),
            list(response.served_by),
            list(response.failed_over),
            moved,
            list(response.busy),
            [list(sample) for sample in response.grad_samples],
            response.samples_problem() if keep_records else None,
            list(response.steps_done),
        )

    async def _read_chain(self, peer_id: str, request, limits: StreamLimits) -> Received[ChainResponse]:
        stream = await self.transport.iterate(peer_id, RPC_TRAIN_CHAIN, request, runtime_pb2.ExpertResponse, limits)
        return await read_response(stream, ChainResponse, max_decoded_bytes=0)

    async def commit(
        self,
        peer_id: str,
        *,
        stage: int,
        step_id: str,
        group_size: int,
        timeout_s: float,
        samples: dict[str, int] | None = None,
        catch_up_from: str | None = None,
        catch_up_to: int | None = None,
        catch_up_drops_gradients: bool = True,
        catch_up_rounds: int | None = None,
        gloo_rendezvous: str | None = None,
        sync_exchange: bool = False,
        flush: bool = False,
        clip_phase: str | None = None,
        clip_scale: float | None = None,
    ) -> CommitResponse:
        """Sync averaging: tell one replica the step is over (`samples`: what each replica of the
        stage served in it, which caps its weight in the round). Raises PeerCallError on failure."""
        message = unary_request(
            CommitRequest(
                model=self.model,
                stage=stage,
                num_stages=self.num_stages,
                step_id=step_id,
                group_size=group_size,
                samples=samples or {},
                credential=self.credential,
                catch_up_from=catch_up_from,
                catch_up_to=catch_up_to,
                catch_up_drops_gradients=catch_up_drops_gradients,
                catch_up_rounds=catch_up_rounds,
                gloo_rendezvous=gloo_rendezvous,
                sync_exchange=sync_exchange,
                flush=flush,
                clip_phase=clip_phase,
                clip_scale=clip_scale,
                spec_version=self.spec_version,
            )
        )
        try:
            reply = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(
                    PeerID.from_base58(peer_id), RPC_COMMIT, message, runtime_pb2.ExpertResponse
                ),
                timeout=timeout_s,
            )
            response = read_unary(reply, CommitResponse)
        except TimeoutError:
            raise PeerCallError(
                peer_id, Failure.TIMEOUT, f"commit on stage {stage} took over {timeout_s:.0f} s"
            ) from None
        except ProtocolError as e:
            raise PeerCallError(peer_id, Failure.GARBAGE, str(e)) from None
        except Exception as e:
            raise PeerCallError(peer_id, Failure.TRANSPORT, f"{type(e).__name__}: {e}") from None
        if response.error:
            raise PeerCallError(peer_id, Failure.REFUSED, response.error)
        return response

    async def _answer(
        self,
        peer_id: str,
        name: str,
        request: AsyncIterator[runtime_pb2.ExpertRequest],
        max_answer_bytes: int | None,
        timeout_s: float,
        what: str,
    ) -> Received[ResponseHeader]:
        """`_exchange` within `timeout_s`, its failures as PeerCallError (`what`: the call, for the message)."""
        try:
            return await asyncio.wait_for(
                self._exchange(peer_id, name, request, max_answer_bytes, timeout_s), timeout=timeout_s
            )
        except TimeoutError:
            raise PeerCallError(peer_id, Failure.TIMEOUT, f"{what} took over {timeout_s:.1f} s") from None
        except StreamClosedError as e:  # the connection dropped: not an answer, so not garbage
            raise PeerCallError(peer_id, Failure.TRANSPORT, str(e)) from None
        except ProtocolError as e:
            raise PeerCallError(peer_id, Failure.GARBAGE, str(e)) from None
        except Exception as e:  # hivemind raises assorted errors for dead or unreachable peers
            raise PeerCallError(peer_id, Failure.TRANSPORT, f"{type(e).__name__}: {e}") from None

    async def _exchange(
        self,
        peer_id: str,
        name: str,
        request: AsyncIterator[runtime_pb2.ExpertRequest],
        max_answer_bytes: int | None = None,
        timeout_s: float = 600.0,
    ) -> Received[ResponseHeader]:
        # Each answer message is read within a size bound: a replica's 512 MiB message is refused unread.
        # (The first waits for the peer's compute: the call's own timeout, which fires first, bounds the reads.)
        limits = StreamLimits(read_timeout_s=timeout_s + 5.0)
        stream = await self.transport.iterate(peer_id, name, request, runtime_pb2.ExpertResponse, limits)
        return await read_response(stream, ResponseHeader, max_decoded_bytes=max_answer_bytes)
