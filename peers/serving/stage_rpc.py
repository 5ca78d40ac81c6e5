"""The stage RPCs: forward and backward requests, decoded on the event loop and computed on one thread.

`StageRpcService` serves the stage of a `ServingState` (peers/serving/serving_state.py), which a move
may swap at any time: every request reads the runtime it computes on from there. The admission guard
(peers/serving/admission.py) has admitted the caller and limits the request's size before a handler
here runs; a handler reports bad requests back to it, so that a caller who keeps sending them is
refused for a while. A call sent while its trainer's commit travelled waits for that commit first
(`follow_commit`, peers/serving/commit_order.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Executor

import torch

from dht.records import PeerState
from peers.compute.compute_thread import BACKWARD, FORWARD, submit_at
from peers.compute.faults import FaultyStageRuntime, InjectedLostAnswer
from peers.compute.stage_runtime import ActivationCacheMissError, BadRequestError, StageRuntime, WrongStageError
from peers.metrics import PeerMetrics
from peers.serving.admission import AdmissionError, AdmissionGuard, NotAllowedError, caller_id, failure_kind
from peers.serving.commit_order import FOLLOW_WAIT_S
from peers.serving.hop_codecs import own_precision
from peers.serving.serving_state import ServingState
from process.phase_times import PhaseTimes
from wire import compression
from wire.failures import Failure
from wire.messages import read_request, write_response
from wire.protocol import (
    ChainRequest,
    ComputeBusy,
    FollowsCommit,
    HopRecordRequest,
    ProtocolError,
    RequestHeader,
    ResponseHeader,
)
from wire.request_limits import InFlightBudgetError, InFlightBytes, RequestTooLargeError
from wire.tensors import decoded_nbytes, encode_tensor

logger = logging.getLogger(__name__)


class StageRpcService:
    def __init__(
        self,
        serving: ServingState,
        compute: Executor,
        guard: AdmissionGuard,
        *,
        model: str,
        max_concurrent_requests: int,
        byte_counter: compression.ByteCounter,
        metrics: PeerMetrics,
        max_decoded_bytes: int | None = None,
        decoded_budget: InFlightBytes | None = None,
        peer_id: str = "",
    ):
        self.serving, self.compute, self.guard = serving, compute, guard
        self.peer_id = peer_id  # what a call's FollowsCommit names this peer by
        self.max_decoded_bytes = max_decoded_bytes  # what one request's tensors may decode to
        self.decoded_budget = decoded_budget  # what all requests' decoded tensors may hold at once
        self.model, self.bytes, self.metrics = model, byte_counter, metrics
        self.slots = asyncio.Semaphore(max_concurrent_requests)

    async def rpc_forward(self, requests, context):
        async for message in self._serve("forward", requests, caller_id(context)):
            yield message

    async def rpc_backward(self, requests, context):
        async for message in self._serve("backward", requests, caller_id(context)):
            yield message

    def refused(self, rpc: str):
        """What `rpc` answers a caller the admission guard refused; counted as a failed request."""

        def answer(error: AdmissionError, waited_s: float):
            self.serving.requests_failed += 1
            self.metrics.observe_request(
                stage=self.serving.runtime.stage, rpc=rpc, duration_s=waited_s, failure_kind=failure_kind(error)
            )
            busy = isinstance(error, InFlightBudgetError)  # not the caller's fault: it retries elsewhere
            kind = Failure.INTERNAL if busy else Failure.BAD_REQUEST
            return write_response(ResponseHeader(error=str(error), error_kind=kind))

        return answer

    async def _serve(self, rpc: str, requests, caller: str = "unknown"):
        serving = self.serving
        received = time.perf_counter()
        serving.in_flight += 1
        decoded = None
        failed_as, queue_s, compute_s, samples, lost = None, None, None, 0, False
        try:
            # The guard cuts `requests` off past --max-request-mb (RequestTooLargeError, after reading the rest).
            # ...and its header past --max-decoded-mb (DecodedTooLargeError, before the parts are read).
            request = await read_request(requests, RequestHeader, max_decoded_bytes=self.max_decoded_bytes)
            arrived = time.perf_counter()  # the whole request is here: from now on, time is the peer's own
            header = request.header
            if header.rpc != rpc:
                raise ProtocolError(f"a {header.rpc!r} header was sent to the {rpc!r} handler")
            # before anything is decoded: only a run's trainers may run what changes the weights
            evaluating = header.rpc == "forward" and header.evaluate
            self.guard.authorize(caller, header.credential, "evaluate" if evaluating else "train")
            self.check_route(header)
            if header.response_codec not in compression.known_codecs():
                raise ProtocolError(
                    f"unknown response codec {header.response_codec!r}; this peer knows "
                    f"{', '.join(compression.known_codecs())}"
                )
            # What the decoded tensors will hold, counted in the peer's budget until the answer is sent
            # (InFlightBudgetError when requests waiting for the compute thread already hold too much).
            if self.decoded_budget is not None:
                decoded = self.decoded_budget.open(caller)
                decoded.take(decoded_nbytes(header.tensors.values()))
            phases = serving.phases
            phases.add("receive", arrived - received)
            with phases.timed("decode"):
                tensors = serving.runtime.pin_for_device(request.decoded(self.bytes, max_bytes=self.max_decoded_bytes))
            await follow_commit(serving, header.follows_commit, self.peer_id)
            decoded_at = time.perf_counter()
            async with self.slots:
                # Timed on the compute thread itself: waiting for that one thread behind other requests is
                # queueing, not compute (a trainer that counted it would think its busiest replica slow).
                priority = BACKWARD if rpc == "backward" else FORWARD  # 1F1B: a backward waits less
                (outputs, loss, grad_sample, steps_done), compute_started, compute_s = await asyncio.wrap_future(
                    submit_at(self.compute, priority, compute_timed, serving, self._compute, header, tensors)
                )
            phases.add("queue", compute_started - decoded_at)
            *tensors_out, loss = await on_host([tensor for _, tensor in outputs] + [loss])
            outputs = [(name, tensor) for (name, _), tensor in zip(outputs, tensors_out)]
            queue_s, samples = compute_started - arrived, 0 if header.evaluate or header.check else header.batch_size
            with phases.timed("encode"):
                encoded_outputs = [(name, self._encode_output(name, tensor, header)) for name, tensor in outputs]
            if isinstance(serving.runtime, FaultyStageRuntime):  # --faults claim_speedup: a replica that lies
                compute_s, queue_s = serving.runtime.claimed_times(compute_s, queue_s)
                lost = serving.runtime.answer_lost(rpc)  # --faults lose_answer
            response = ResponseHeader(
                loss=loss,
                compute_s=compute_s,
                queue_s=queue_s,
                busy=busy_reading(serving),
                grad_sample=grad_sample,
                steps_done=steps_done,
            )
            serving.served_one()
        except ActivationCacheMissError as e:  # routine, not a failure: the trainer resends with the inputs
            kind = Failure.CACHE_MISS
            logger.debug(f"{rpc}: {e}")
            response, encoded_outputs = ResponseHeader(error=str(e), error_kind=kind), []
        except InFlightBudgetError as e:  # busy, not the caller's fault: it retries elsewhere
            serving.requests_failed += 1
            failed_as = Failure.TOO_LARGE
            logger.info(f"Refused a {rpc} request from {caller[-8:]}: {e}")
            response, encoded_outputs = ResponseHeader(error=str(e), error_kind=Failure.INTERNAL), []
        except (ProtocolError, BadRequestError, RequestTooLargeError) as e:
            serving.requests_failed += 1
            wrong_stage = isinstance(e, WrongStageError)
            kind = Failure.WRONG_STAGE if wrong_stage else Failure.BAD_REQUEST
            if not wrong_stage:  # a stale route is no offence
                self.guard.penalize(caller)
            failed_as = (
                Failure.TOO_LARGE
                if isinstance(e, RequestTooLargeError)
                else Failure.NOT_ALLOWED
                if isinstance(e, NotAllowedError)
                else kind
            )
            logger.warning(f"Refused a {rpc} request from {caller[-8:]}: {e}")
            response, encoded_outputs = ResponseHeader(error=str(e), error_kind=kind), []
        except (MemoryError, torch.OutOfMemoryError):  # this request was too big for us now; keep serving
            serving.requests_failed += 1
            failed_as = Failure.INTERNAL
            logger.error(f"Out of memory serving a {rpc} request from {caller[-8:]}; refused it and kept serving")
            response, encoded_outputs = (
                ResponseHeader(error="the peer ran out of memory computing this request", error_kind=Failure.INTERNAL),
                [],
            )
        except Exception as e:  # a bug or resource failure here must not take the peer down
            serving.requests_failed += 1
            logger.exception(f"{rpc} failed")
            failed_as = Failure.INTERNAL
            response, encoded_outputs = (
                ResponseHeader(error=f"{type(e).__name__}: {e}", error_kind=Failure.INTERNAL),
                [],
            )
        finally:
            serving.in_flight -= 1
            if decoded is not None:
                decoded.close()
            self.metrics.observe_request(
                stage=serving.runtime.stage,
                rpc=rpc,
                duration_s=time.perf_counter() - received,
                samples=samples,
                queue_s=queue_s,
                compute_s=compute_s,
                failure_kind=getattr(failed_as, "value", failed_as),
            )
        if lost:  # the stream fails: hivemind ends it with an error, which the caller sees as a transport failure
            raise InjectedLostAnswer(f"the answer to this {rpc} was lost (--faults lose_answer)")
        for message in timed_messages(serving.phases, write_response(response, encoded_outputs, self.bytes)):
            yield message

    def _encode_output(self, name: str, tensor: torch.Tensor, header: RequestHeader) -> compression.EncodedTensor:
        """Encode with the codec the caller asked for; top-k gradients keep an error-feedback residual."""
        feedback = self.serving.feedback if name == "grad_inputs" and header.response_codec == "topk" else None
        codec, params = own_precision(
            header.response_codec, header.response_codec_params, self.serving.runtime.precision
        )
        return encode_tensor(tensor, codec, params, feedback=feedback, feedback_key=name)

    def check_route(self, header: RequestHeader | ChainRequest | HopRecordRequest) -> None:
        """Refuse a request for another model, split or stage than this peer serves (WrongStageError
        when only the stage differs: a stale route)."""
        runtime = self.serving.runtime
        if header.model != self.model or header.num_stages != runtime.num_stages:
            raise ProtocolError(
                f"this peer serves {self.model} split into {runtime.num_stages} "
                f"stages, not {header.model} in {header.num_stages}"
            )
        if self.serving.state == PeerState.STANDBY:
            raise WrongStageError("this peer is a standby: it serves no stage yet")
        if header.stage != runtime.stage:
            raise WrongStageError(f"this peer serves stage {runtime.stage}, not stage {header.stage}")

    def _compute(self, header: RequestHeader, tensors: dict[str, torch.Tensor]):
        """Runs on the compute thread (where a move swaps the runtime, and a commit steps it: read it
        once, here). Returns the named tensors to answer, the loss, the gradient sample (a backward
        that asked for it) and the steps the parameters computed on had taken."""
        runtime = self.serving.runtime
        if header.stage != runtime.stage:  # the peer moved while this request waited for the thread
            raise WrongStageError(f"this peer moved to stage {runtime.stage}, not serving stage {header.stage}")
        steps_done = runtime.steps_done  # before: a backward that completes the peer's own batch steps it
        return (*self._answer(runtime, header, tensors), steps_done)

    def _answer(self, runtime: StageRuntime, header: RequestHeader, tensors: dict[str, torch.Tensor]):
        """`_compute`'s answer but the steps: what the request asks of `runtime`."""
        inputs = tensors.get("inputs")
        if header.inputs_cached and header.rpc == "backward":
            if inputs is not None:
                raise BadRequestError("inputs_cached is set, yet the request carries 'inputs'")
            if header.check:
                raise BadRequestError("a spot check's recompute carries its inputs (inputs_cached is set)")
            grad_inputs, loss, grad_sample = runtime.backward_sampled(
                header.microbatch_id,
                None,
                batch_size=header.batch_size,
                grad_outputs=tensors.get("grad_outputs"),
                targets=tensors.get("targets"),
                sample=header.grad_sample,
            )  # the token ids, too, come from the cached forward
            return ([("grad_inputs", grad_inputs)] if grad_inputs is not None else []), loss, grad_sample
        if inputs is None:
            raise BadRequestError("the request carries no 'inputs' tensor")
        if inputs.shape[:1] != (header.batch_size,):
            raise BadRequestError(f"batch_size says {header.batch_size}, inputs have shape {tuple(inputs.shape)}")
        if header.check:
            if header.evaluate:
                raise BadRequestError("a request is a spot check's recompute or a validation pass, not both")
            answer, loss, grad_sample = runtime.recompute(
                header.rpc,
                inputs,
                targets=tensors.get("targets"),
                grad_outputs=tensors.get("grad_outputs"),
                tokens=tensors.get("tokens"),
                precision=header.check_precision,
            )
            name = "outputs" if header.rpc == "forward" else "grad_inputs"
            return ([(name, answer)] if answer is not None else []), loss, grad_sample
        if header.rpc == "forward" and header.evaluate:
            outputs = runtime.evaluate(inputs, tensors.get("targets"), tensors.get("tokens"))
            return ([], runtime.host_value(outputs), None) if runtime.is_last else ([("outputs", outputs)], None, None)
        if header.rpc == "forward":
            outputs = runtime.forward(header.microbatch_id, inputs, tensors.get("targets"), tensors.get("tokens"))
            if runtime.is_last:
                return [], runtime.host_value(outputs), None
            return [("outputs", outputs)], None, None
        grad_inputs, loss, grad_sample = runtime.backward_sampled(
            header.microbatch_id,
            inputs,
            grad_outputs=tensors.get("grad_outputs"),
            targets=tensors.get("targets"),
            tokens=tensors.get("tokens"),
            sample=header.grad_sample,
        )
        return ([("grad_inputs", grad_inputs)] if grad_inputs is not None else []), loss, grad_sample


async def follow_commit(
    serving: ServingState, follows: FollowsCommit | None, peer_id: str, timeout_s: float = FOLLOW_WAIT_S
) -> None:
    """Before a call computes: the trainer's commit it follows handled here first, if it names this
    peer (peers/serving/commit_order.py), waiting `timeout_s` at most (then it computes as it is)."""
    if follows is None or not follows.names(peer_id) or serving.commits.handled(follows.step_id):
        return
    started, bound_s = time.perf_counter(), min(timeout_s, FOLLOW_WAIT_S)
    if not await serving.commits.wait(follows.step_id, bound_s):
        logger.info(f"the commit {follows.step_id} a call follows did not come within {bound_s:.1f} s; computing")
    serving.phases.add("commit_wait", time.perf_counter() - started)  # only the calls that were held


def compute_timed(serving: ServingState, compute, *args):
    """On the compute thread: `compute(*args)`, counted busy on the peer's compute clock and in its
    "compute" phase; returns its result, when it started and how long it ran (perf_counter seconds)."""
    started, cpu = time.perf_counter(), time.thread_time()
    result = serving.compute_clock.run(compute, *args)
    duration = time.perf_counter() - started
    serving.phases.add("compute", duration, time.thread_time() - cpu)
    return result, started, duration


async def on_host(values: list):
    """`values` once their copies to the host are complete (`StageRuntime.host_ready`): waited for
    in a helper thread when one is still on its way (CUDA), neither the compute thread nor the event
    loop; at once otherwise."""
    if all(getattr(value, "ready", None) is None for value in values):
        return values
    return await asyncio.get_running_loop().run_in_executor(None, lambda: [StageRuntime.host_ready(v) for v in values])


def busy_reading(serving: ServingState) -> ComputeBusy:
    """The peer's compute clock now, as its answers carry it."""
    busy_s, clock_s = serving.compute_clock.reading()
    return ComputeBusy(busy_s=busy_s, clock_s=clock_s)


def timed_messages(phases: PhaseTimes, messages: Iterable):
    """`messages`, each one's making timed as "serialize" (CPU too) and the transport's taking of it
    (until the next is asked for) as "send" (wall)."""
    iterator = iter(messages)
    while True:
        with phases.timed("serialize"):
            message = next(iterator, None)
        if message is None:
            return
        handed = time.perf_counter()
        yield message
        phases.add("send", time.perf_counter() - handed)
