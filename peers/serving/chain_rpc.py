"""Direct routing's RPC: one microbatch's training pass, from this peer's stage to the last, stage to stage.

`ChainService.rpc_train_chain` serves a `ChainRequest` (wire/protocol.py): it runs this stage's
forward on the compute thread, sends the outputs to the next stage's first candidate of the
trainer's route (swarm/trainer/chain_route.py), tries the route's next candidate when that hop
fails, runs its own backward on the gradient that comes back and answers the loss, its
`grad_inputs` and which peer served each stage (`served_by`). The last stage runs the fused
forward+backward that owns the loss.

- Codecs per hop: the sender encodes its outputs and asks for the gradient in what `HopCodecs`
  (peers/serving/hop_codecs.py) chooses for the link; integer tensors travel as they are.
- Exactly once: a replica counts a microbatch's gradients at most once (`StageRuntime.backward`
  keeps the ids it counted), and a call whose stream broke is asked again of the same replica
  first (wire/call_rules.py, `asks_again`).
- Hops larger than `piece_bytes` (`--hop-piece-kb`) cross on several streams at once
  (peers/serving/hop_pieces.py); a hop over the data plane is one call on one TCP connection.
- Spot checks: with `keep_records` a peer keeps what crossed its hops (`HopRecords`) and
  `rpc_hop_record` hands a record to the trainer that drove the chain.
- Security: a chain must name this peer's model, stage count and stage; in a run with an
  authority the trainer's credential rides along every hop; held tensors count in `--max-in-flight-mb`.

Why, and the limits of exactly-once: docs/design/serving.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from contextlib import nullcontext

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from dht.records import PeerState
from models.stages import boundary_width
from peers.compute.compute_thread import BACKWARD, FORWARD, submit_at
from peers.compute.faults import FaultyStageRuntime, InjectedLostAnswer
from peers.compute.stage_runtime import BadRequestError, StageRuntime, WrongStageError
from peers.serving.admission import NotAuthorizedError, caller_id, failure_kind
from peers.serving.hop_codecs import HopCodecs, gradient_feedback_key, own_precision
from peers.serving.hop_pieces import HopPieces, MissingPiecesError
from peers.serving.hop_records import HopRecords
from peers.serving.link_turns import LinkTurns
from peers.serving.stage_rpc import (
    StageRpcService,
    busy_reading,
    compute_timed,
    follow_commit,
    on_host,
    timed_messages,
)
from wire.bounded_streams import StreamLimits, call_on_streams
from wire.call_rules import Attempts
from wire.compression import MIN_PART_BYTES, CodecChoice, EncodedTensor, estimated_nbytes
from wire.failures import Failure, caller_failure
from wire.messages import (
    Received,
    read_request,
    read_response,
    read_response_pieces,
    read_unary,
    request_pieces,
    response_pieces,
    write_request,
    write_response,
)
from wire.protocol import (
    HOP_RECORD_NAMES,
    MAX_CHAIN_STAGES,
    MAX_HOP_PIECES,
    MAX_SAMPLED_STAGES,
    RPC_CHAIN_PIECE,
    RPC_TRAIN_CHAIN,
    ChainPiece,
    ChainRequest,
    ChainResponse,
    HopFailover,
    HopRecordRequest,
    ProtocolError,
    ResponseHeader,
)
from wire.request_limits import InFlightBudgetError, RequestTooLargeError, check_request_bytes
from wire.tensors import check_codec, decoded_nbytes, encode_tensor
from wire.transport import Transport

logger = logging.getLogger(__name__)

OWN_SHARE_MIN = 0.1  # of a chained call's time, what a peer keeps for its own compute at least


class PieceRefusedError(Exception):
    """A piece of a chained call this peer refused: its stream ends with this error."""


class ChainHopError(Exception):
    """The call to the next stage failed on every candidate the route names (or deeper down);
    `failovers`: each candidate tried on the way, and how it failed."""

    def __init__(
        self,
        stage: int,
        peers: list[str],
        message: str,
        kind: Failure = Failure.INTERNAL,
        failovers: list[HopFailover] | None = None,
    ):
        super().__init__(message)
        self.stage, self.peers, self.kind, self.failovers = stage, peers, kind, failovers or []


def hop_timeout_s(budget_s: float, stage: int, num_stages: int) -> float:
    """Of a chained call's `budget_s` on `stage`, the time its call to the next stage may take: the
    stages after it get their share of the budget, this one keeps its own for its compute."""
    after = num_stages - 1 - stage
    return budget_s * max(after / (after + 1), OWN_SHARE_MIN)


class ChainService:
    """Serves RPC_TRAIN_CHAIN for the stage a `StageRpcService` serves (the same runtime, compute
    thread, admission guard, budgets and counters)."""

    def __init__(
        self,
        stages: StageRpcService,
        *,
        record_bytes: int,
        credential: str | None = None,
        piece_bytes: int = 0,
        claim_s: float = 120.0,
    ):
        self.stages = stages
        self.piece_bytes = piece_bytes  # a hop larger than this crosses in pieces of about this size; 0: never
        self.claim_s = claim_s  # how long a piece waits for its call to take it (the request deadline)
        self.credential = credential  # this peer's own run credential, shown to the next stage's peer
        self.p2p = None  # set when the host registers its RPCs
        self.codecs = HopCodecs()  # each hop's codec, and this peer's measure of its hops' links
        self.turns = LinkTurns()  # what this peer sends to one peer goes one stream at a time
        # how this peer calls the next stage's replicas: the data plane or kept p2pd streams (set with p2p)
        self.transport: Transport | None = None
        self.records = HopRecords(record_bytes)  # what crossed this peer's hops, for the trainer's spot checks
        self.pieces = HopPieces()  # the pieces of the calls in pieces this peer receives

    async def rpc_train_chain(self, requests, context):
        stages, serving = self.stages, self.stages.serving
        caller = caller_id(context)
        received = time.perf_counter()
        serving.in_flight += 1
        held = None
        failed_as, samples, lost, pieces, hop_id = None, 0, False, 1, None
        try:
            request = await read_request(requests, ChainRequest, max_decoded_bytes=stages.max_decoded_bytes)
            header = request.header
            pieces, hop_id = header.pieces, header.hop_id
            self._authorize(caller, header)
            self._check_route(header)
            check_codec(header.response_codec, header.response_codec_params)
            if pieces > 1:  # the other streams' parts, after this one's
                wait_s = min(header.timeout_s, self.claim_s)
                parts = (*request.parts, *await self.pieces.collect(caller, hop_id, pieces, wait_s))
                check_request_bytes(sum(len(part.buffer) for part in parts), stages.guard.max_request_bytes)
                request = Received(header, parts)
            arrived = time.perf_counter()
            phases = serving.phases
            phases.add("receive", arrived - received)
            runtime = serving.runtime
            outputs_nbytes = header.batch_size * runtime.config.seq_len * boundary_width(runtime.config) * 4
            if stages.decoded_budget is not None:  # held until answered: inputs, and outputs while waiting
                held = stages.decoded_budget.open(caller)
                held.take(decoded_nbytes(header.tensors.values()) + 2 * outputs_nbytes)
            encoded = request.encoded(stages.bytes)
            with phases.timed("decode"):
                tensors = runtime.pin_for_device(request.decoded(max_bytes=stages.max_decoded_bytes))
            inputs = tensors.get("inputs")
            if inputs is None or inputs.shape[:1] != (header.batch_size,):
                raise BadRequestError(f"the request carries no 'inputs' of {header.batch_size} samples")
            if header.keep_records and header.stage > 0:  # the stage before's outputs as they crossed
                self.records.keep(header.microbatch_id, "received", header.trainer_id, encoded["inputs"])
            tokens = tensors.get("tokens")  # where the stage needs the token ids (a subspace model)
            await follow_commit(serving, header.follows_commit, self.peer_id, header.timeout_s / 2)
            sample = header.keep_records  # a run that spot-checks: each stage's gradient sample comes back
            if header.stage == header.num_stages - 1:
                (grad_inputs, loss, grad_sample), compute_s, steps_done = await self._on_compute(
                    header,
                    BACKWARD,
                    lambda r: r.backward_sampled(
                        header.microbatch_id, inputs, targets=tensors.get("targets"), tokens=tokens, sample=sample
                    ),
                )
                grad_inputs, loss = await on_host([grad_inputs, loss])
                served_by, failed_over, busy_after, grad_samples, steps_after = [], [], [], [], []
            else:
                outputs, forward_s, steps_done = await self._on_compute(
                    header, FORWARD, lambda r: r.forward(header.microbatch_id, inputs, tokens=tokens)
                )
                (outputs,) = await on_host([outputs])
                carried = encoded.get("inputs") if header.stage == 0 else encoded.get("tokens")
                answer, grad_outputs, skipped = await self._next_hop(
                    header,
                    outputs,
                    encoded.get("targets"),
                    tokens=carried if runtime.config.subspace_rank > 0 else None,
                )
                (grad_inputs, _, grad_sample), backward_s, _ = await self._on_compute(
                    header,
                    BACKWARD,
                    lambda r: r.backward_sampled(
                        header.microbatch_id, inputs, grad_outputs=grad_outputs, tokens=tokens, sample=sample
                    ),
                )
                (grad_inputs,) = await on_host([grad_inputs])
                loss, served_by, busy_after = answer.loss, list(answer.served_by), list(answer.busy)
                grad_samples, steps_after = list(answer.grad_samples), list(answer.steps_done)
                if len(steps_after) != len(served_by):  # a later peer did not say: nobody's steps are told
                    steps_after = None
                failed_over = [*skipped, *answer.failed_over][:MAX_CHAIN_STAGES]
                compute_s = forward_s + backward_s
            samples = header.batch_size
            with phases.timed("encode"):
                outputs = (
                    [] if grad_inputs is None else [("grad_inputs", self._encode_gradient(grad_inputs, header, caller))]
                )
            if header.keep_records and outputs:  # the gradient as it goes back to the stage before
                self.records.keep(header.microbatch_id, "grad_sent", header.trainer_id, outputs[0][1])
            response = ChainResponse(
                loss=loss,
                served_by=[self.peer_id, *served_by],
                failed_over=failed_over,
                compute_s=compute_s,
                handler_s=time.perf_counter() - arrived,
                busy=[busy_reading(serving), *busy_after][:MAX_CHAIN_STAGES],
                grad_samples=[grad_sample, *grad_samples][:MAX_SAMPLED_STAGES] if grad_sample is not None else [],
                steps_done=[steps_done, *steps_after][:MAX_CHAIN_STAGES] if steps_after is not None else [],
            )
            serving.served_one()
            if isinstance(runtime, FaultyStageRuntime):  # --faults lose_answer: this stage's backward is added
                lost = runtime.answer_lost("backward")
        except ChainHopError as e:
            serving.requests_failed += 1
            failed_as = Failure.INTERNAL
            logger.info(f"train_chain: {e}")
            response, outputs = (
                ChainResponse(
                    error=str(e)[:4000],
                    error_kind=e.kind,
                    failed_stage=e.stage,
                    failed_peers=e.peers[:8],
                    failed_over=e.failovers[:MAX_CHAIN_STAGES],
                ),
                [],
            )
        except InFlightBudgetError as e:  # busy, not the caller's fault: it retries elsewhere
            serving.requests_failed += 1
            failed_as = Failure.TOO_LARGE
            response, outputs = self._refusal(str(e), Failure.INTERNAL), []
        except MissingPiecesError as e:  # the caller's other streams broke, most likely: no penalty
            serving.requests_failed += 1
            failed_as = Failure.TRANSPORT
            logger.info(f"train_chain from {caller[-8:]}: {e}")
            response, outputs = self._refusal(str(e), Failure.INTERNAL), []
        except (ProtocolError, BadRequestError, RequestTooLargeError) as e:
            serving.requests_failed += 1
            wrong_stage = isinstance(e, WrongStageError)
            failed_as = Failure.WRONG_STAGE if wrong_stage else Failure.BAD_REQUEST
            if not wrong_stage:
                stages.guard.penalize(caller)
            logger.warning(f"Refused a train_chain request from {caller[-8:]}: {e}")
            response, outputs = self._refusal(str(e), failed_as), []
        except Exception as e:  # a bug or resource failure here must not take the peer down
            serving.requests_failed += 1
            failed_as = Failure.INTERNAL
            logger.exception("train_chain failed")
            response, outputs = self._refusal(f"{type(e).__name__}: {e}", Failure.INTERNAL), []
        finally:
            serving.in_flight -= 1
            if held is not None:
                held.close()
            stages.metrics.observe_request(
                stage=serving.runtime.stage,
                rpc="train_chain",
                duration_s=time.perf_counter() - received,
                samples=samples,
                failure_kind=getattr(failed_as, "value", failed_as),
            )
        try:
            if lost:  # the stream fails: hivemind ends it with an error, which the caller sees as a transport failure
                raise InjectedLostAnswer("the answer to this chained call was lost (--faults lose_answer)")
            with serving.phases.timed("serialize"):
                first, *others = response_pieces(response, outputs, pieces, stages.bytes)
            # a gradient goes back to the caller in turn with the others on that link, every piece of it
            async with self.turns.turn(caller) if outputs else nullcontext():
                if others:
                    self.pieces.answer(caller, hop_id, others)
                for message in timed_messages(serving.phases, first):
                    yield message
                if others:
                    await self.pieces.all_sent(caller, hop_id, self.claim_s)
        finally:
            if pieces > 1:
                self.pieces.close(caller, hop_id)

    async def rpc_chain_piece(self, requests, context):
        """One of a chained call's other streams (`ChainPiece`): its parts go to the call, and its
        stream carries back the same piece of the call's answer (peers/serving/hop_pieces.py). A
        piece is refused by ending its stream with an error (PieceRefusedError), which fails its
        call on the caller's side at once, without waiting for the call's own answer."""
        caller, received = caller_id(context), time.perf_counter()
        try:
            piece = await read_request(requests, ChainPiece)
            hop_id, index = piece.header.hop_id, piece.header.index
            claim_s = min(piece.header.timeout_s, self.claim_s)
            answer = await self.pieces.deliver(
                caller, hop_id, index, piece.parts, claim_s=claim_s, timeout_s=piece.header.timeout_s
            )
        except ProtocolError as e:
            self.stages.guard.penalize(caller)
            logger.warning(f"Refused a chain piece from {caller[-8:]}: {e}")
            self._observe_piece(received, Failure.BAD_REQUEST)
            raise PieceRefusedError(str(e)) from None
        try:
            for message in answer:
                yield message
        finally:
            self.pieces.sent(caller, hop_id, index)
            self._observe_piece(received)

    def refused_piece(self, error, waited_s: float):
        """A piece the admission guard refused: its stream ends with the error (see rpc_chain_piece)."""
        self._observe_piece(time.perf_counter() - waited_s, failure_kind(error))
        raise PieceRefusedError(str(error))

    def _observe_piece(self, received: float, failed_as: Failure | str | None = None) -> None:
        self.stages.metrics.observe_request(
            stage=self.stages.serving.runtime.stage,
            rpc="chain_piece",
            duration_s=time.perf_counter() - received,
            failure_kind=getattr(failed_as, "value", failed_as),
        )

    async def rpc_hop_record(self, request: runtime_pb2.ExpertRequest, context):
        """What crossed one of this peer's hops for a microbatch (peers/serving/hop_records.py): only
        to the trainer that drove the chain, only for the stage this peer serves."""
        caller = caller_id(context)
        try:
            wanted = read_unary(request, HopRecordRequest)
            self.stages.guard.authorize(caller, wanted.credential, "train")
            self.stages.check_route(wanted)
            tensor = self.records.find(wanted.microbatch_id, wanted.side, caller)
            if tensor is None:
                raise ProtocolError(
                    f"no record of what this peer {wanted.side} for {wanted.microbatch_id} in a chain you drove "
                    f"(it keeps the last {self.records.max_bytes >> 20} MiB)"
                )
            header = ResponseHeader()
            outputs = [(HOP_RECORD_NAMES[wanted.side], tensor)]
        except (ProtocolError, NotAuthorizedError) as e:
            header, outputs = (
                ResponseHeader(
                    error=str(e)[:4000],
                    error_kind=Failure.WRONG_STAGE if isinstance(e, WrongStageError) else Failure.BAD_REQUEST,
                ),
                [],
            )
        for message in write_response(header, outputs, self.stages.bytes):
            yield message

    @staticmethod
    def refused_record(error, waited_s: float):
        return write_response(ResponseHeader(error=str(error)[:4000], error_kind=Failure.BAD_REQUEST))

    def refused(self, error, waited_s: float):
        """What a caller the admission guard refused is answered; counted as a failed request."""
        serving = self.stages.serving
        serving.requests_failed += 1
        self.stages.metrics.observe_request(
            stage=serving.runtime.stage, rpc="train_chain", duration_s=waited_s, failure_kind=failure_kind(error)
        )
        kind = Failure.INTERNAL if isinstance(error, InFlightBudgetError) else Failure.BAD_REQUEST
        return write_response(self._refusal(str(error), kind))

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58() if self.p2p is not None else "unknown"

    @staticmethod
    def _refusal(error: str, kind: Failure) -> ChainResponse:
        """This peer's own refusal or failure: no `failed_stage`, the caller knows which stage it called."""
        return ChainResponse(error=error[:4000], error_kind=kind)

    def _authorize(self, caller: str, header: ChainRequest) -> None:
        guard = self.stages.guard
        if caller == header.trainer_id:  # the trainer itself: as for any training request
            guard.authorize(caller, header.credential, "train")
            return
        if header.stage == 0:
            raise NotAuthorizedError(f"a chain's first stage is called by its trainer, not by peer {caller[-8:]}")
        guard.authorize(header.trainer_id, header.credential, "train")  # the trainer that started the chain
        guard.authorize(
            caller, header.forwarder_credential, "chain", stage=header.stage - 1
        )  # ...from the stage before

    def _check_route(self, header: ChainRequest) -> None:
        self.stages.check_route(header)
        expected = header.num_stages - 1 - header.stage
        if len(header.route) != expected:
            raise ProtocolError(
                f"a chained call to stage {header.stage} of {header.num_stages} must name candidates for "
                f"{expected} later stages, not {len(header.route)}"
            )

    async def _on_compute(self, header: ChainRequest, priority: int, compute):
        """`compute(runtime)` on the compute thread, within the peer's request slots, the seconds it
        took there, and the steps the parameters it computed on had taken; WrongStageError when the
        peer moved to another stage since the request arrived."""

        def run():
            runtime: StageRuntime = self.stages.serving.runtime
            if header.stage != runtime.stage or self.stages.serving.state == PeerState.STANDBY:
                raise WrongStageError(f"this peer moved to stage {runtime.stage}, not serving stage {header.stage}")
            steps_done = runtime.steps_done  # before: a backward that completes the peer's own batch steps it
            return compute(runtime), steps_done

        serving = self.stages.serving
        queued = time.perf_counter()
        async with self.stages.slots:
            (result, steps_done), started, compute_s = await asyncio.wrap_future(
                submit_at(self.stages.compute, priority, compute_timed, serving, run)
            )
        serving.phases.add("queue", started - queued)
        return result, compute_s, steps_done

    def _encode_gradient(self, grad_inputs: torch.Tensor, header: ChainRequest, caller: str) -> EncodedTensor:
        """'grad_inputs' in the codec the caller asked for; top-k keeps its residual here, the
        gradient's sender, per caller (peers/serving/hop_codecs.py)."""
        topk = header.response_codec == "topk"
        codec, params = own_precision(
            header.response_codec, header.response_codec_params, self.stages.serving.runtime.precision
        )
        return encode_tensor(
            grad_inputs,
            codec,
            params,
            feedback=self.stages.serving.feedback if topk else None,
            feedback_key=gradient_feedback_key(caller),
            max_part_bytes=self._part_bytes if header.pieces > 1 else None,
        )

    @property
    def _part_bytes(self) -> int | None:
        """The parts a tensor of a hop in pieces is cut into: the piece size, or the codecs' own."""
        return max(self.piece_bytes, MIN_PART_BYTES) if self.piece_bytes else None

    def _piece_count(self, sent: list[tuple[str, EncodedTensor]], numel: int, response_codec: CodecChoice) -> int:
        """The streams a hop crosses on: pieces of about `piece_bytes` each way (the answer's
        gradient of `numel` values, estimated for its codec), within MAX_HOP_PIECES. Rounded to the
        nearest, so a piece may be up to half as large again: the targets that ride along do not
        cost a stream of their own."""
        if not self.piece_bytes:
            return 1
        try:
            fraction = float(response_codec.params.get("fraction", 1.0))
            back = estimated_nbytes(response_codec.codec, numel, 4, fraction)
        except (ValueError, TypeError):
            back = 4 * numel
        out = sum(item.nbytes for _, item in sent)
        return max(1, min(MAX_HOP_PIECES, (2 * max(out, back) + self.piece_bytes) // (2 * self.piece_bytes)))

    async def _next_hop(
        self,
        header: ChainRequest,
        outputs: torch.Tensor,
        targets: EncodedTensor | None,
        *,
        tokens: EncodedTensor | None = None,
    ) -> tuple[ChainResponse, torch.Tensor, list[HopFailover]]:
        """Call the next stage's candidates in the route's order until one answers; its answer, the
        gradient wrt this stage's outputs and the candidates that failed before it, each with how.
        ChainHopError when every candidate failed, or when a candidate answered that a stage after it
        failed (its own route is spent: the trainer re-drives)."""
        if self.p2p is None or self.transport is None:
            raise ChainHopError(header.stage + 1, [], "this peer cannot call other peers yet")
        next_stage, deadline = (
            header.stage + 1,
            time.monotonic() + hop_timeout_s(header.timeout_s, header.stage, header.num_stages),
        )
        phases = self.stages.serving.phases
        encodings: dict[tuple, EncodedTensor] = {}  # the outputs per codec choice, each made once
        # what passes on as it came: the targets, and the token ids a subspace model's later stages need
        carried = [(name, item) for name, item in (("targets", targets), ("tokens", tokens)) if item is not None]
        # the rules every caller of a replica follows (wire/call_rules.py): a hop adds work, and waits on
        # the hops after it unless it goes to the last stage
        attempts = Attempts(adds_work=True, waits_on_others=next_stage < header.num_stages - 1)
        tried, candidates = [], list(header.route[0])

        def failovers(but: str | None = None) -> list[HopFailover]:
            failed_as = {f.peer_id: f.kind for f in attempts.failures}  # how each candidate tried last failed
            return [HopFailover(peer=p, stage=next_stage, kind=failed_as[p]) for p in tried if p != but]

        while True:
            peer_id = attempts.take_again() or (candidates.pop(0) if candidates else None)
            timeout_s = deadline - time.monotonic()
            if peer_id is None or timeout_s <= 0:
                break
            if peer_id not in tried:
                tried.append(peer_id)
            sent, response_codec = self._hop_tensors(header, peer_id, outputs, carried, encodings)
            # over the data plane a hop is one call on one connection: no stream windows to fit
            direct = await self.transport.direct(peer_id)
            pieces = 1 if direct else self._piece_count(sent, outputs.numel(), response_codec)
            request = ChainRequest(
                model=header.model,
                stage=next_stage,
                num_stages=header.num_stages,
                microbatch_id=header.microbatch_id,
                batch_size=header.batch_size,
                route=header.route[1:],
                timeout_s=timeout_s,
                trainer_id=header.trainer_id,
                credential=header.credential,
                forwarder_credential=self.credential,
                codec=header.codec,
                topk_fraction=header.topk_fraction,
                loss_budget=header.loss_budget,
                response_codec=response_codec.codec,
                response_codec_params=response_codec.params,
                keep_records=header.keep_records,
                follows_commit=header.follows_commit,
                pieces=pieces,
                hop_id=secrets.token_hex(8) if pieces > 1 else None,  # new on every attempt
            )
            for _, item in sent:
                self.stages.bytes.record_sent(item)
            started = time.perf_counter()
            try:
                answer = await asyncio.wait_for(self._call(peer_id, request, sent), timeout=timeout_s)
                phases.add("hop_wait", time.perf_counter() - started)
            except TimeoutError:
                attempts.failed(peer_id, Failure.TIMEOUT, f"{peer_id[-8:]}: no answer within {timeout_s:.1f} s")
                continue
            except Exception as e:  # hivemind raises assorted errors for dead or unreachable peers
                # the stream broke: its stages may hold this microbatch already, and only they answer a
                # repeat without adding it: the rules ask it again first
                attempts.failed(peer_id, Failure.TRANSPORT, f"{peer_id[-8:]}: {type(e).__name__}: {e}")
                continue
            response = answer.header
            if response.error is not None:
                if response.failed_stage is not None and response.failed_stage > next_stage:
                    raise ChainHopError(
                        response.failed_stage,
                        list(response.failed_peers),
                        response.error,
                        Failure.INTERNAL,
                        [*failovers(but=peer_id), *response.failed_over],
                    )
                attempts.failed(peer_id, caller_failure(response.error_kind), f"{peer_id[-8:]}: {response.error}")
                continue
            try:
                with phases.timed("hop_decode"):
                    grad = answer.decoded(self.stages.bytes, max_bytes=decoded_nbytes_limit(outputs)).get("grad_inputs")
                self.stages.serving.runtime.check_grad_outputs(header.batch_size, grad)
                (grad,) = self.stages.serving.runtime.pin_for_device({"grad": grad}).values()
                if len(response.served_by) != header.num_stages - next_stage or response.served_by[0] != peer_id:
                    raise BadRequestError(f"it says stages were served by {len(response.served_by)} peers")
                if next_stage == header.num_stages - 1 and response.loss is None:
                    raise BadRequestError("the last stage answered no loss")
                if header.keep_records and response.samples_problem() is not None:
                    raise BadRequestError(response.samples_problem())
            except (ProtocolError, BadRequestError) as e:
                attempts.failed(peer_id, Failure.GARBAGE, f"{peer_id[-8:]}: a malformed answer: {e}")
                continue
            if header.keep_records:
                self.records.keep(header.microbatch_id, "sent", header.trainer_id, dict(sent)["inputs"])
                self.records.keep(
                    header.microbatch_id, "grad_received", header.trainer_id, answer.encoded()["grad_inputs"]
                )
            self.codecs.observe(
                peer_id,
                next_stage,
                nbytes=sum(item.nbytes for _, item in sent) + sum(item.nbytes for item in answer.encoded().values()),
                elapsed_s=time.perf_counter() - started,
                handler_s=response.handler_s,
                compute_s=response.compute_s,
                batch_size=header.batch_size,
            )
            return response, grad, failovers(but=peer_id)
        raise ChainHopError(
            next_stage,
            tried,
            f"stage {next_stage}: no candidate of the route answered "
            f"({'; '.join(f.reason for f in attempts.failures) or 'no time left'})",
            failovers=failovers(),
        )

    def _hop_tensors(
        self,
        header: ChainRequest,
        peer_id: str,
        outputs: torch.Tensor,
        carried: list[tuple[str, EncodedTensor]],
        encodings: dict[tuple, EncodedTensor],
    ) -> tuple[list[tuple[str, EncodedTensor]], CodecChoice]:
        """What goes to `peer_id`: the outputs in the codec chosen for that link (top-k activations
        without error feedback, as under hub routing), the `carried` tensors as they came; and the
        codec that replica answers the gradient with."""
        stage, numel = header.stage + 1, outputs.numel()

        def choose(is_gradient: bool) -> CodecChoice:
            return self.codecs.choose(
                header.codec,
                header.topk_fraction,
                peer_id,
                stage,
                numel,
                header.batch_size,
                is_gradient=is_gradient,
                loss_budget=math.inf if header.loss_budget is None else header.loss_budget,
            )

        asked = choose(False)
        choice = CodecChoice(*own_precision(asked.codec, asked.params, self.stages.serving.runtime.precision))
        key = (choice.codec, tuple(sorted(choice.params.items())))
        if key not in encodings:
            with self.stages.serving.phases.timed("encode"):
                encodings[key] = encode_tensor(outputs, choice.codec, choice.params, max_part_bytes=self._part_bytes)
        return [("inputs", encodings[key]), *carried], choose(True)

    async def _call(self, peer_id: str, request: ChainRequest, tensors: list[tuple[str, EncodedTensor]]):
        limits = StreamLimits(read_timeout_s=request.timeout_s + 5.0)
        if request.pieces > 1:  # each piece on a stream of its own, all written in one turn on the link

            def piece_header(index: int) -> ChainPiece:
                return ChainPiece(hop_id=request.hop_id, index=index, timeout_s=request.timeout_s)

            groups = request_pieces(request, tensors, piece_header)
            answers = await call_on_streams(
                self.p2p,
                PeerID.from_base58(peer_id),
                [(RPC_CHAIN_PIECE if index else RPC_TRAIN_CHAIN, group) for index, group in enumerate(groups)],
                runtime_pb2.ExpertResponse,
                limits,
                pool=self.transport.streams,
                turn=self.turns.turn(peer_id),
            )
            return await read_response_pieces(answers, ChainResponse, max_decoded_bytes=self.stages.max_decoded_bytes)
        stream = await self.transport.iterate(
            peer_id,
            RPC_TRAIN_CHAIN,
            self.turns.in_turn(peer_id, write_request(request, tensors)),
            runtime_pb2.ExpertResponse,
            limits,
        )
        return await read_response(stream, ChainResponse, max_decoded_bytes=self.stages.max_decoded_bytes)


def decoded_nbytes_limit(outputs: torch.Tensor) -> int:
    """What the gradient wrt `outputs` may decode to: float64 of that shape, the widest dtype on the wire."""
    return 8 * outputs.numel() + (1 << 20)
