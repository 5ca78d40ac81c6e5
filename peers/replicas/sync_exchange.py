"""Exact sync's round by exchange (`--averaging-transport exchange`; auto's choice where gloo may
not be used, as in a run with an authority): the replicas a commit names fetch each other's gradient.

- On a commit that names its group (the replicas and what each served), each member publishes its
  mean gradient of the step (a 1-D float32 copy) under the commit's step id, and fetches every other
  member's (RPC_SYNC_ROUND) through the peer's transport: the data plane (direct TLS, both ends
  known by their libp2p identities) where it reaches the member, else p2pd. Every member then holds
  the same payloads and takes the same mean, in the same order: weighted by the commit's samples
  (nobody weighs more than its count), or in a group of three or more with robust averaging, the
  same robust mean (peers/replicas/robust_mean.py). The replicas stay equal to the last bit.
- A published gradient is answered to the members the commit names only, once each, when they ask
  with the same group digest (members and samples). A request that comes before this replica's
  commit waits for it, up to the round's timeout (at most MAX_WAITING such requests at a time). A
  publication is dropped once every other member has it, or at the timeout; HELD_ROUNDS at most.
  Nothing is sent unasked, so a stranger can neither fill a replica's memory nor join its round.
- Any failure to fetch (a dead member, a refusal, the timeout) fails the round on that member, as
  a failed hivemind round does; the trainer repairs a round that failed on one side only.
The compute thread waits in `average` while the peer's event loop fetches (gloo's and hivemind's
rounds hold it the same way).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.proto import runtime_pb2

from peers.replicas.robust_mean import robust_mean_by_segment
from peers.serving.admission import caller_id
from wire.bounded_streams import StreamLimits
from wire.compression import EncodedTensor, decode, encode
from wire.messages import read_request, read_response, write_request, write_response
from wire.protocol import RPC_SYNC_ROUND, ProtocolError, SyncRoundRequest, SyncRoundResponse

logger = logging.getLogger(__name__)

PAYLOAD = "gradient"
HELD_ROUNDS = 4  # rounds whose gradient a replica keeps published at once
MAX_WAITING = 64  # requests that wait for this replica's commit at once; more are refused


def group_digest(weights: Mapping[str, float]) -> str:
    """What every member of a round must agree on: its members and the weight of each."""
    text = "\n".join(f"{peer} {float(weights[peer])!r}" for peer in sorted(weights))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> torch.Tensor:
    """sum(w_i * t_i) / sum(w_i) into `out` (which may not be one of `tensors`), summed in the given
    order: every member computes the same operations on the same values, so gets the same bits."""
    total = float(sum(weights))
    torch.mul(tensors[0], float(weights[0]) / total, out=out)
    for tensor, weight in zip(tensors[1:], weights[1:]):
        out.add_(tensor, alpha=float(weight) / total)
    return out


@dataclass
class Published:
    readers: frozenset[str]  # the other members: who may fetch it
    group: str
    payload: EncodedTensor
    served: set[str] = field(default_factory=set)


class SyncExchange:
    """This peer's side of the exchange: its published gradients, the RPC that answers them, and
    the round a commit runs (`average`, on the compute thread). `bind` connects it to the peer's
    event loop and transport once they exist (peers/serving/host.py)."""

    def __init__(self, *, model: str, timeout_s: float):
        self.model, self.timeout_s = model, timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport = None  # wire/transport.py's Transport
        self.averaging: Callable[[], object] = lambda: None
        self.authorize: Callable[..., None] = lambda *args, **kwargs: None
        self.credential: str | None = None
        self.published: OrderedDict[str, Published] = OrderedDict()
        self.in_flight: set = set()  # the rounds `average` waits for (concurrent futures), for `cancel`
        self.waiting = 0
        self._changed: asyncio.Condition | None = None

    def bind(self, *, loop, transport, averaging: Callable[[], object], authorize=None, credential=None) -> None:
        """`averaging()`: the stage's averaging now (a move swaps it); `authorize(caller, credential,
        action, stage=...)`: the admission guard's; `credential`: this peer's, shown to the others."""
        self.loop, self.transport, self.averaging = loop, transport, averaging
        self.authorize = authorize or self.authorize
        self.credential = credential
        self._changed = asyncio.Condition()

    # --- the round, on the compute thread ---------------------------------------------------------------
    def average(
        self,
        flat: torch.Tensor,
        *,
        leader: str | None,
        step_id: str,
        me: str,
        weights: Mapping[str, float],
        robust: str = "none",
        tensor_sizes: Sequence[int] | None = None,
    ) -> bool:
        """Replace `flat` (this replica's mean gradient) with the members' mean; False (`flat` then
        unchanged) when the round failed. `leader` is gloo's and is not used here."""
        members = sorted(weights)
        runtime = getattr(self.averaging(), "runtime", None)
        if self.loop is None or self.transport is None or runtime is None or me not in weights:
            logger.warning("exact sync by exchange: this peer's transport is not ready; the round fails")
            return False
        if float(sum(weights.values())) <= 0:
            return False
        own = flat.to(torch.float32, copy=True)
        request = SyncRoundRequest(
            model=self.model,
            stage=runtime.stage,
            num_stages=runtime.num_stages,
            step_id=step_id,
            group=group_digest(weights),
            credential=self.credential,
        )
        others = [peer for peer in members if peer != me]
        future = asyncio.run_coroutine_threadsafe(self._round(request, others, encode(own, "none")), self.loop)
        self.in_flight.add(future)
        try:
            fetched = future.result(timeout=self.timeout_s + 10.0)
        except concurrent.futures.CancelledError:
            logger.info("exact sync by exchange: the round was cancelled (the peer is stopping, or moving)")
            return False
        except Exception as e:  # noqa: BLE001 - a round that broke fails, nothing more
            future.cancel()
            logger.warning(f"exact sync by exchange of {len(members)} replicas broke: {type(e).__name__}: {e}")
            return False
        finally:
            self.in_flight.discard(future)
        if fetched is None:
            return False
        try:
            gathered = [own if peer == me else decode(fetched[peer]) for peer in members]
        except Exception as e:  # noqa: BLE001 - a payload that does not decode fails the round
            logger.warning(f"exact sync by exchange: a replica's gradient did not decode: {e}")
            return False
        member_weights = [max(float(weights[peer]), 1e-9) for peer in members]
        if robust != "none" and len(members) >= 3:
            segments = list(tensor_sizes) if tensor_sizes else [own.numel()]
            reduced = robust_mean_by_segment(gathered, member_weights, segments, robust)
            if reduced.clipped:
                clipped = ", ".join(members[i][-8:] for i in reduced.clipped)
                logger.warning(f"Robust averaging ({robust}) clipped the gradient of {clipped}, far from the others'")
            flat.copy_(reduced.value)
        else:
            weighted_mean(gathered, member_weights, out=flat)  # `own` is a copy: flat may be overwritten
        return True

    def cancel(self) -> None:
        """End the rounds in flight now (the peer stops, or its stage's averaging is swapped): the
        compute thread waiting in `average` returns at once, its round failed. Any thread may call it."""
        for future in list(self.in_flight):
            future.cancel()

    async def _round(
        self, request: SyncRoundRequest, others: list[str], payload: EncodedTensor
    ) -> dict[str, EncodedTensor] | None:
        """Publish this replica's payload, then fetch the others'; None when any fetch failed."""
        await self._publish(request.step_id, Published(frozenset(others), request.group, payload))
        numel = payload.header.shape[0]
        results = await asyncio.gather(*[self._fetch(peer, request, numel) for peer in others], return_exceptions=True)
        failures = [f"{peer[-8:]}: {why}" for peer, why in zip(others, results) if isinstance(why, BaseException)]
        if failures:
            averaging = self.averaging()
            if not getattr(averaging, "closing", False):
                logger.warning(
                    f"stage {request.stage}: exact sync by exchange with {len(others)} replica(s) failed "
                    f"({'; '.join(failures)}); not stepping"
                )
            return None
        return dict(zip(others, results))

    async def _fetch(self, peer: str, request: SyncRoundRequest, numel: int) -> EncodedTensor:
        async def call() -> EncodedTensor:
            answers = await self.transport.iterate(
                peer,
                RPC_SYNC_ROUND,
                write_request(request),
                runtime_pb2.ExpertResponse,
                StreamLimits(read_timeout_s=self.timeout_s + 5.0),
            )
            received = await read_response(answers, SyncRoundResponse, max_decoded_bytes=4 * numel + 4096)
            if received.header.error:
                raise ProtocolError(received.header.error)
            tensors = received.encoded()
            payload = tensors.get(PAYLOAD)
            if payload is None or len(tensors) != 1:
                raise ProtocolError(f"an answer carries one tensor, {PAYLOAD!r}")
            if payload.header.shape != (numel,) or payload.header.dtype != "float32":
                raise ProtocolError(f"the gradient is {numel} float32 values, not {payload.header.shape}")
            return payload

        try:
            return await asyncio.wait_for(call(), timeout=self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer within {self.timeout_s:.0f} s") from None

    async def _publish(self, step_id: str, published: Published) -> None:
        async with self._changed:
            self.published[step_id] = published
            while len(self.published) > HELD_ROUNDS:
                self.published.popitem(last=False)
            self._changed.notify_all()
        self.loop.call_later(self.timeout_s + 5.0, self._drop, step_id, published)

    def _drop(self, step_id: str, published: Published) -> None:
        if self.published.get(step_id) is published:
            del self.published[step_id]

    # --- answering, on the event loop -------------------------------------------------------------------
    @staticmethod
    def refused(error: Exception, waited_s: float):
        return write_response(SyncRoundResponse(error=str(error)[:1000]))

    async def rpc_sync_round(self, requests: AsyncIterator, context) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            payload = await self.answer((await read_request(requests, SyncRoundRequest)).header, caller_id(context))
            messages = write_response(SyncRoundResponse(), [(PAYLOAD, payload)])
        except ProtocolError as e:
            messages = write_response(SyncRoundResponse(error=str(e)[:1000]))
        for message in messages:
            yield message

    async def answer(self, request: SyncRoundRequest, caller: str) -> EncodedTensor:
        """This replica's payload of `request.step_id` for `caller`, once it is published; raises
        ProtocolError (the reason) otherwise."""
        averaging = self.averaging()
        runtime = getattr(averaging, "runtime", None)
        if runtime is None or getattr(averaging, "exchange", None) is not self or self._changed is None:
            raise ProtocolError("this replica takes no exact sync rounds by exchange")
        self.authorize(caller, request.credential, "average", stage=runtime.stage)
        if (request.model, request.stage, request.num_stages) != (self.model, runtime.stage, runtime.num_stages):
            raise ProtocolError(f"this peer serves {self.model} stage {runtime.stage}/{runtime.num_stages}")
        published = self.published.get(request.step_id)
        if published is None:
            if self.waiting >= MAX_WAITING:
                raise ProtocolError("too many requests wait for commits here")
            self.waiting += 1
            try:
                async with self._changed:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: request.step_id in self.published), timeout=self.timeout_s
                    )
            except TimeoutError:
                raise ProtocolError(f"no commit of this step came here within {self.timeout_s:.0f} s") from None
            finally:
                self.waiting -= 1
            published = self.published.get(request.step_id)
            if published is None:  # published and already dropped (newer rounds came)
                raise ProtocolError("this replica's gradient of this step is no longer held")
        if caller not in published.readers:
            raise ProtocolError("the commit of this step does not name the caller")
        if request.group != published.group:
            raise ProtocolError("the caller's commit names other replicas or samples than this one's")
        if caller in published.served:
            raise ProtocolError("this replica's gradient of this step went to the caller already")
        published.served.add(caller)
        if published.served >= published.readers:
            self._drop(request.step_id, published)
        return published.payload
