"""The stage RPCs: forward and backward requests, decoded on the event loop and computed on one thread.

`StageRpcHandlers` is mixed into `PeerServer` (peers/serving/server.py), which owns the state these handlers
use: the config, the `StageRuntime`, the compute executor, the metrics and the request counters.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from dht.records import PeerState
from peers.compute.stage_runtime import ActivationCacheMissError, BadRequestError
from wire import compression
from wire.failures import Failure
from wire.messages import read_request, write_response
from wire.protocol import ProtocolError, RequestHeader, ResponseHeader
from wire.request_limits import RequestTooLargeError
from wire.tensors import encode_tensor

logger = logging.getLogger(__name__)


class WrongStageError(ProtocolError):
    """The request names a stage this peer does not serve (the trainer's view of the swarm is stale)."""


class RateLimitedError(ProtocolError):
    """The caller sent too many bad requests lately (wire/request_limits.py)."""


class NotAllowedError(ProtocolError):
    """A private swarm's peer was called by a peer id not on its allowlist."""


async def _drain(requests, max_bytes: int) -> None:
    """Read (and drop, undecoded) what the caller sends, up to `max_bytes`."""
    received = 0
    async for message in requests:
        received += len(message.metadata) + sum(len(part.buffer) for part in message.tensors)
        if received > max_bytes:
            return


def _caller(context) -> str:
    remote = getattr(context, "remote_id", None)
    return remote.to_base58() if remote is not None else "unknown"


class StageRpcHandlers:
    async def rpc_forward(self, requests, context):
        async for message in self._serve("forward", requests, _caller(context)):
            yield message

    async def rpc_backward(self, requests, context):
        async for message in self._serve("backward", requests, _caller(context)):
            yield message

    async def _serve(self, rpc: str, requests, caller: str = "unknown"):
        received = time.perf_counter()
        self.in_flight += 1
        failure_kind, queue_s, compute_s, samples = None, None, None, 0
        try:
            max_bytes = int(self.config.max_request_mb * (1 << 20))
            if self.config.allowed_peers and caller not in self.config.allowed_peers:
                failure_kind = Failure.NOT_ALLOWED
                await _drain(requests, max_bytes)  # answering before the caller finished sending resets the stream
                raise NotAllowedError(f"this is a private swarm and peer {caller} is not on its --allowed-peers")
            if not self.penalties.allows(caller):  # refused before anything is decoded
                failure_kind = Failure.RATE_LIMITED
                await _drain(requests, max_bytes)
                raise RateLimitedError(
                    f"too many bad requests from {caller[-8:]}; refused for the next "
                    f"{self.penalties.seconds_until_allowed(caller):.0f} s"
                )
            try:
                request = await read_request(requests, RequestHeader, max_bytes=max_bytes)
            except RequestTooLargeError:
                await _drain(requests, max_bytes)  # let the caller finish sending: it gets our answer, not a reset
                raise
            arrived = time.perf_counter()  # the whole request is here: from now on, time is the peer's own
            header = request.header
            if header.rpc != rpc:
                raise ProtocolError(f"a {header.rpc!r} header was sent to the {rpc!r} handler")
            self._check_route(header)
            if header.response_codec not in compression.known_codecs():
                raise ProtocolError(
                    f"unknown response codec {header.response_codec!r}; this peer knows "
                    f"{', '.join(compression.known_codecs())}"
                )
            tensors = request.decoded(self.bytes)
            async with self._semaphore:
                # Timed on the compute thread itself: waiting for that one thread behind other requests is
                # queueing, not compute (a trainer that counted it would think its busiest replica slow).
                (outputs, loss), compute_started, compute_s = await asyncio.get_running_loop().run_in_executor(
                    self.executor, _timed, self._compute, header, tensors
                )
            queue_s, samples = compute_started - arrived, header.batch_size
            encoded_outputs = [(name, self._encode_output(name, tensor, header)) for name, tensor in outputs]
            response = ResponseHeader(loss=loss, compute_s=compute_s, queue_s=queue_s)
            self.requests_served += 1
            if self.requests_served == 1 and self.announced_online_at is not None:
                print(
                    f"first request served {time.monotonic() - self.announced_online_at:.2f} s after the "
                    f"online record was stored",
                    flush=True,
                )
        except ActivationCacheMissError as e:  # routine, not a failure: the trainer resends with the inputs
            kind = Failure.CACHE_MISS
            logger.debug(f"{rpc}: {e}")
            response, encoded_outputs = ResponseHeader(error=str(e), error_kind=kind), []
        except (ProtocolError, BadRequestError, RequestTooLargeError) as e:
            self.requests_failed += 1
            kind = Failure.WRONG_STAGE if isinstance(e, WrongStageError) else Failure.BAD_REQUEST
            if not isinstance(e, (WrongStageError, RateLimitedError, NotAllowedError)):  # a stale route is no offence
                self.penalties.penalize(caller)
            failure_kind = failure_kind or (Failure.TOO_LARGE if isinstance(e, RequestTooLargeError) else kind)
            if not isinstance(e, (RateLimitedError, NotAllowedError)):
                logger.warning(f"Refused a {rpc} request from {caller[-8:]}: {e}")
            response, encoded_outputs = ResponseHeader(error=str(e), error_kind=kind), []
        except (MemoryError, torch.OutOfMemoryError):  # this request was too big for us now; keep serving
            self.requests_failed += 1
            failure_kind = Failure.INTERNAL
            logger.error(f"Out of memory serving a {rpc} request from {caller[-8:]}; refused it and kept serving")
            response, encoded_outputs = (
                ResponseHeader(error="the peer ran out of memory computing this request", error_kind=Failure.INTERNAL),
                [],
            )
        except Exception as e:  # a bug or resource failure here must not take the peer down
            self.requests_failed += 1
            logger.exception(f"{rpc} failed")
            failure_kind = Failure.INTERNAL
            response, encoded_outputs = (
                ResponseHeader(error=f"{type(e).__name__}: {e}", error_kind=Failure.INTERNAL),
                [],
            )
        finally:
            self.in_flight -= 1
            self.metrics.observe_request(
                stage=self.runtime.stage,
                rpc=rpc,
                duration_s=time.perf_counter() - received,
                samples=samples,
                queue_s=queue_s,
                compute_s=compute_s,
                failure_kind=getattr(failure_kind, "value", failure_kind),
            )
        for message in write_response(response, encoded_outputs, self.bytes):
            yield message

    def _encode_output(self, name: str, tensor: torch.Tensor, header: RequestHeader) -> compression.EncodedTensor:
        """Encode with the codec the caller asked for; top-k gradients keep an error-feedback residual."""
        feedback = self.feedback if name == "grad_inputs" and header.response_codec == "topk" else None
        return encode_tensor(
            tensor, header.response_codec, header.response_codec_params, feedback=feedback, feedback_key=name
        )

    def _check_route(self, header: RequestHeader) -> None:
        if header.model != self.config.model or header.num_stages != self.runtime.num_stages:
            raise ProtocolError(
                f"this peer serves {self.config.model} split into {self.runtime.num_stages} "
                f"stages, not {header.model} in {header.num_stages}"
            )
        if self.state == PeerState.STANDBY:
            raise WrongStageError("this peer is a standby: it serves no stage yet")
        if header.stage != self.runtime.stage:
            raise WrongStageError(f"this peer serves stage {self.runtime.stage}, not stage {header.stage}")

    def _compute(self, header: RequestHeader, tensors: dict[str, torch.Tensor]):
        """Runs on the compute thread."""
        if header.stage != self.runtime.stage:  # the peer moved while this request waited for the thread
            raise WrongStageError(f"this peer moved to stage {self.runtime.stage}, not serving stage {header.stage}")
        inputs = tensors.get("inputs")
        if header.inputs_cached and header.rpc == "backward":
            if inputs is not None:
                raise BadRequestError("inputs_cached is set, yet the request carries 'inputs'")
            grad_inputs, loss = self.runtime.backward(
                header.microbatch_id,
                None,
                batch_size=header.batch_size,
                grad_outputs=tensors.get("grad_outputs"),
                targets=tensors.get("targets"),
            )
            return ([("grad_inputs", grad_inputs)] if grad_inputs is not None else []), loss
        if inputs is None:
            raise BadRequestError("the request carries no 'inputs' tensor")
        if inputs.shape[:1] != (header.batch_size,):
            raise BadRequestError(f"batch_size says {header.batch_size}, inputs have shape {tuple(inputs.shape)}")
        if header.rpc == "forward":
            outputs = self.runtime.forward(header.microbatch_id, inputs, tensors.get("targets"))
            if self.runtime.is_last:
                return [], float(outputs)
            return [("outputs", outputs)], None
        grad_inputs, loss = self.runtime.backward(
            header.microbatch_id, inputs, grad_outputs=tensors.get("grad_outputs"), targets=tensors.get("targets")
        )
        return ([("grad_inputs", grad_inputs)] if grad_inputs is not None else []), loss


def _timed(compute, *args):
    """Run `compute(*args)`; returns its result, when it started and how long it ran (perf_counter seconds)."""
    started = time.perf_counter()
    result = compute(*args)
    return result, started, time.perf_counter() - started
