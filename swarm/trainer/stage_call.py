"""One microbatch's call to one stage, with failover: the trainer's retry loop.

`StageCaller.call` picks a replica of the stage (the stage's `ReplicaScheduler` in the
`SwarmView`, swarm/trainer/discovery.py), encodes what it sends with the codec that replica's link
calls for, sends it through `StageClient.exchange` (swarm/trainer/client.py, which sends encoded
tensors and decodes the answer), and checks the answer. A failed call is noted (the scheduler, a
ban, a counter, a metric) and retried on another replica; after `max_retries` failures, or when no
replica can take the call, it waits for the stage (refreshing the view) until one can or
`stage_wait_timeout_s` runs out, which stops the run with an error instead of losing data. The
bookkeeping itself (timeouts, bans, the retry budget) is pure: swarm/trainer/failures.py.

`StageCaller.verify` is the spot check (issue #25): the same request sent again to a second replica,
and to a third when the answers differ; the decisions (which call, the tolerance, the minority) are
pure: swarm/trainer/spot_checks.py.

Encoding lives here and only here. A `Payload` is a tensor together with the encodings made or
received of it so far, one per codec choice: each is made once (a retry, or the backward that
resends a forward's inputs, reuses it), and an encoding that came over the wire from one stage is
sent on to the next as it came (no decode + re-encode) when the next link uses the same codec.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from swarm.trainer.client import PeerCallError, StageClient
from swarm.trainer.config import FailoverSettings
from swarm.trainer.contributions import ContributionLedger
from swarm.trainer.discovery import SwarmView
from swarm.trainer.failures import (
    NotAllowedError,
    RetriesExhaustedError,
    RetryBudget,
    StageUnavailableError,
    TimeoutPolicy,
    refused_as_not_allowed,
)
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.service_clock import ServiceClock
from swarm.trainer.spot_checks import CallSampler, comparable_replicas, judge, tolerance, unchecked_because
from wire.compression import CodecChoice, EncodedTensor, ErrorFeedback
from wire.compression.policy import CodecPolicy
from wire.failures import Failure
from wire.protocol import ResponseHeader
from wire.tensors import encode_tensor

logger = logging.getLogger(__name__)


def codec_key(choice: CodecChoice) -> tuple:
    """What makes two encodings of one tensor the same: the codec and its parameters."""
    return choice.codec, tuple(sorted(choice.params.items()))


@dataclass
class Payload:
    """A tensor to send, and its encodings made or received so far (codec key -> encoding)."""

    tensor: torch.Tensor
    encodings: dict[tuple, EncodedTensor] = field(default_factory=dict)


@dataclass
class CallCounters:
    calls_retried: int = 0
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    calls_by_peer: dict[str, int] = field(default_factory=dict)
    backward_inputs_skipped: int = 0  # backwards answered from the peer's activation cache, inputs not resent
    backward_inputs_resent: int = 0  # ... tried without inputs, but the peer had no cached forward
    backward_asked_again: int = 0  # backwards (chains) that failed in transit, asked of the same replica(s) once more
    calls_verified: int = 0  # forward calls sent to a second replica too (spot checks)
    verify_mismatches: int = 0  # ... whose answers differed beyond the codec's error
    verify_calls: int = 0  # extra calls the spot checks made (second and third replicas), answered or not
    verify_records_missing: int = 0  # chains (direct routing) picked for a check whose hop records could not be had
    banned_peers: dict[str, str] = field(default_factory=dict)  # peer id -> why it was banned for the run
    verify_largest_agreeing_difference: float = 0.0  # the tolerance's margin: the most two agreeing answers differed


@dataclass(frozen=True)
class StageAnswer:
    outputs: dict[str, torch.Tensor]
    response: ResponseHeader
    peer_id: str  # the replica that answered
    received: dict[str, EncodedTensor]  # the outputs as they came over the wire
    received_codec: tuple  # their codec key
    request: tuple[tuple[str, EncodedTensor], ...] = ()  # what was sent, as sent (a spot check resends it)

    def payload(self, name: str) -> Payload:
        """Output `name`, to send on to the next stage in the encoding it came in."""
        return Payload(self.outputs[name], {self.received_codec: self.received[name]} if name in self.received else {})


def answer_bytes_limit(numel_out: int) -> int:
    """The most an answer's tensors may decode to: the activations (or their gradient) of the
    microbatch as float64, the widest dtype on the wire, plus 1 MiB."""
    return 8 * numel_out + (1 << 20)


class StageCaller:
    def __init__(
        self,
        view: SwarmView,
        client: StageClient,
        *,
        d_model: int,
        seq_len: int,
        failover: FailoverSettings,
        codecs: CodecPolicy | None = None,
        verify_fraction: float = 0.0,
        seed: int = 0,
        say=print,
    ):
        self.view, self.client = view, client
        self.d_model, self.seq_len = d_model, seq_len
        self.max_retries, self.stage_wait_timeout_s = failover.max_retries, failover.stage_wait_timeout_s
        self.codecs = codecs or CodecPolicy("none")
        self.feedback = ErrorFeedback()  # top-k gradient residuals, one per destination stage
        self.timeouts = TimeoutPolicy()
        self.service = ServiceClock()  # routing's measure of each replica: the trainer's own clock
        self.counters = CallCounters()
        self.contributions = ContributionLedger()  # what each peer served, failed, and how checks judged it
        self.not_allowed_by: dict[str, str] = {}  # peers of a private swarm that refused us: never asked again
        self.spot_checks = CallSampler(verify_fraction, seed=seed)  # which forward calls to verify
        self.told_unchecked: set[str] = set()  # replicas whose answers cannot be compared, told once
        self._say = say
        self.metrics: TrainerMetrics = view.metrics  # one registry for the view, the calls and the schedule

    def _encode(
        self, peer_id: str, stage: int, batch_size: int, tensors: list[tuple[str, Payload]]
    ) -> list[tuple[str, EncodedTensor]]:
        """Encode what goes to `peer_id` with the codec its link calls for, reusing an encoding the
        payload already holds for that codec."""
        encoded = []
        for name, payload in tensors:
            is_gradient = name == "grad_outputs"
            choice = self.codecs.choose(peer_id, stage, payload.tensor.numel(), batch_size, is_gradient=is_gradient)
            key = codec_key(choice)
            if key not in payload.encodings:
                feedback = self.feedback if is_gradient and choice.codec == "topk" else None
                payload.encodings[key] = encode_tensor(
                    payload.tensor, choice.codec, choice.params, feedback=feedback, feedback_key=stage
                )
            encoded.append((name, payload.encodings[key]))
        return encoded

    async def call(
        self,
        stage: int,
        rpc: str,
        microbatch_id: str,
        batch_size: int,
        tensors: list[tuple[str, Payload]],
        failures: list[str] | None = None,
        *,
        cached_on: str | None = None,
        evaluate: bool = False,
    ) -> StageAnswer:
        """Call one replica of `stage`, failing over until one answers. Failed attempts are
        appended to `failures`. `cached_on` (backward): the peer that served this microbatch's
        forward on this stage; if it is chosen again, the inputs are not resent (it answers a cache
        miss if it no longer holds them, and they are then sent). `evaluate` (forward): a validation
        pass, which the peer answers without keeping anything or counting the samples."""
        failures = [] if failures is None else failures
        numel_out = batch_size * self.seq_len * self.d_model
        scheduler, bans, newcomers = self.view.schedulers[stage], self.view.bans, self.view.newcomers[stage]
        budget = RetryBudget(stage, max_retries=self.max_retries)
        waited_since, again = None, None  # again: the replica a failed backward is asked of once more
        while True:
            # asked again: charged like any call, so its answer settles its own charge
            asking_again = again is not None and scheduler.charge(again, rpc, batch_size)
            if asking_again:
                peer_id, again = again, None
            else:
                again = None
                exclude = bans.banned() | budget.failed_peers() | self.view.violations.banned(stage)
                exclude |= newcomers.excluded(set(scheduler.keys_s()) - exclude)
                peer_id = scheduler.choose(
                    rpc,
                    batch_size,
                    exclude=exclude | self.not_allowed_by.keys(),
                    cached_on=cached_on if rpc == "backward" else None,
                )
            if peer_id is None and self.not_allowed_by:  # no retry lets us into a private swarm
                raise NotAllowedError(stage, self._my_peer_id(), list(self.not_allowed_by.values()))
            if peer_id is None:
                waited_since = waited_since or time.monotonic()
                await self._wait_for_replica(stage, waited_since, budget)
                budget = RetryBudget(stage, max_retries=self.max_retries)
                continue
            waited_since = None
            newcomers.called(peer_id)
            timeout_s = self.timeouts.timeout_s(stage, rpc)
            started = time.perf_counter()
            # the peer that served the forward cached its inputs (and token ids): not sent again
            # (not when asked again: the failed call took them out of the cache)
            skip_inputs = (
                rpc == "backward"
                and peer_id == cached_on
                and not asking_again
                and any(n == "inputs" for n, _ in tensors)
            )
            try:
                response_codec = self.codecs.choose(
                    peer_id, stage, numel_out, batch_size, is_gradient=rpc == "backward"
                )
                while True:
                    sent = [(n, t) for n, t in tensors if not (skip_inputs and n in ("inputs", "tokens"))]
                    encoded = self._encode(peer_id, stage, batch_size, sent)
                    try:
                        result = await self.client.exchange(
                            peer_id,
                            rpc=rpc,
                            stage=stage,
                            microbatch_id=microbatch_id,
                            batch_size=batch_size,
                            tensors=encoded,
                            timeout_s=timeout_s,
                            response_codec=response_codec,
                            inputs_cached=skip_inputs,
                            evaluate=evaluate,
                            max_answer_bytes=answer_bytes_limit(numel_out),
                        )
                        break
                    except PeerCallError as e:
                        # A cache miss (or an older peer refusing a request without inputs) is no
                        # failure of the peer: ask it again, with the inputs this time.
                        if not (skip_inputs and e.kind in (Failure.CACHE_MISS, Failure.REFUSED)):
                            raise
                        skip_inputs = False
                        self.counters.backward_inputs_resent += 1
                check_answer(
                    peer_id,
                    stage,
                    rpc,
                    num_stages=self.view.num_stages,
                    expected_shape=(batch_size, self.seq_len, self.d_model),
                    outputs=result.outputs,
                    loss=result.response.loss,
                )
                if skip_inputs:
                    self.counters.backward_inputs_skipped += 1
            except PeerCallError as e:
                self.metrics.observe_failure(stage=stage, rpc=rpc, kind=e.kind.value)
                if e.kind == Failure.REFUSED and refused_as_not_allowed(str(e)):
                    self.not_allowed_by[peer_id] = peer_id[-8:]
                    continue
                failed_at = time.perf_counter()
                self.service.finished(peer_id, started, failed_at)
                self._note_failure(stage, peer_id, e, failed_after_s=failed_at - started)
                failures.append(str(e))
                try:
                    budget.record_failure(peer_id, str(e))
                except RetriesExhaustedError as exhausted:
                    logger.warning(str(exhausted))
                    waited_since = time.monotonic()
                    await self._wait_for_replica(stage, waited_since, budget)
                    budget = RetryBudget(stage, max_retries=self.max_retries)
                    continue
                if budget.ask_again(peer_id, rpc, e.kind):  # it may hold this backward already: not twice
                    logger.info(f"stage {stage}: asking {peer_id[-8:]} again first (it may have added this backward)")
                    again = peer_id
                    self.counters.backward_asked_again += 1
                continue
            done = time.perf_counter()
            service_s = self.service.finished(peer_id, started, done)
            self._note_success(
                stage, rpc, peer_id, batch_size, done - started, service_s, result.response, result.moved, skip_inputs
            )
            return StageAnswer(
                result.outputs, result.response, peer_id, result.received, codec_key(response_codec), tuple(encoded)
            )

    async def verify(self, stage: int, microbatch_id: str, batch_size: int, answer: StageAnswer) -> StageAnswer:
        """Spot-check a forward `answer`: send its request, unchanged, to another replica of the stage,
        and to a third when the two answers differ beyond the answer codec's error. A replica whose
        answer is in the minority is banned for the run. Returns the answer to go on with: `answer`,
        unless its replica was in the minority. Without another replica (or when the other fails) the
        call stays unverified; failures of the extra calls are noted like any other."""
        codec = answer.received_codec[0]
        allowed = tolerance(codec)
        answers, by_peer = {answer.peer_id: answer.outputs["outputs"]}, {answer.peer_id: answer}
        second = await self._ask_another(stage, microbatch_id, batch_size, answer, avoid=set(answers))
        if second is None:  # no other replica, or it failed: unverified
            return answer
        answers[second.peer_id], by_peer[second.peer_id] = second.outputs["outputs"], second
        verdict = judge(answers, allowed)
        self._note_spread(verdict.largest_agreeing_difference)
        self.counters.calls_verified += 1
        self.metrics.calls_verified.labels(stage=str(stage)).inc()
        if verdict.agreed:
            self.contributions.verified(stage, answers, agreed=True)
            return answer
        self.counters.verify_mismatches += 1
        self.metrics.verify_mismatches.labels(stage=str(stage)).inc()
        third = await self._ask_another(stage, microbatch_id, batch_size, answer, avoid=set(answers))
        if third is not None:
            answers[third.peer_id], by_peer[third.peer_id] = third.outputs["outputs"], third
            verdict = judge(answers, allowed)
            self._note_spread(verdict.largest_agreeing_difference)
        majority = set(answers) - set(verdict.minority) if verdict.minority else set()
        self.contributions.verified(stage, answers, agreed=verdict.agreed, majority=majority)
        for peer_id in verdict.minority:
            if peer_id in self.counters.banned_peers:  # caught by a check in flight at the same time
                continue
            reason = (
                f"stage {stage}: its forward answer to {microbatch_id} differed from {len(answers) - 1} agreeing "
                f"replicas' beyond the {codec} codec's tolerance {allowed:.2g}"
            )
            self.view.violations.lied(peer_id, reason)
            self.counters.banned_peers[peer_id] = reason
            self.contributions.banned(peer_id, stage, reason)
            self.metrics.verify_bans.labels(stage=str(stage)).inc()
            logger.warning(f"{reason}; banned {peer_id[-8:]} for the run")
        if not verdict.decided:
            logger.warning(
                f"stage {stage}: replicas {sorted(p[-8:] for p in answers)} answered {microbatch_id} differently "
                f"and no replica is in the minority; nobody banned"
            )
        return by_peer[verdict.trusted]

    def _note_spread(self, difference: float) -> None:
        counters = self.counters
        counters.verify_largest_agreeing_difference = max(counters.verify_largest_agreeing_difference, difference)

    async def _ask_another(
        self, stage: int, microbatch_id: str, batch_size: int, asked: StageAnswer, avoid: set[str]
    ) -> StageAnswer | None:
        """`asked`'s request (the same encoded tensors, the same answer codec) sent to one replica of
        `stage` outside `avoid` that averages in sync with `asked`'s; None when none can take it or it fails (no retry: a spot check is
        an extra, not a call the pipeline needs)."""
        scheduler = self.view.schedulers[stage]
        averaging = {r.peer_id: r.averaging for r in self.view.records[stage]}
        unchecked = {r.peer_id: unchecked_because(r.precision, r.weight_prediction) for r in self.view.records[stage]}
        reason = unchecked.get(asked.peer_id)
        if reason is not None and asked.peer_id not in self.told_unchecked:
            self.told_unchecked.add(asked.peer_id)
            logger.warning(f"stage {stage}: replica {asked.peer_id[-8:]} {reason}: its answers are not spot-checked")
        comparable = comparable_replicas(asked.peer_id, averaging, self.view.averaging_members(stage), unchecked)
        exclude = self.view.bans.banned() | self.view.violations.banned(stage) | avoid | self.not_allowed_by.keys()
        exclude |= set(scheduler.keys_s()) - comparable
        exclude |= self.view.newcomers[stage].excluded(set(scheduler.keys_s()) - exclude)
        peer_id = scheduler.choose("forward", batch_size, exclude=exclude)
        if peer_id is None:
            return None
        self.view.newcomers[stage].called(peer_id)  # counts against the newcomers' share like any call
        self.counters.verify_calls += 1
        codec, params = asked.received_codec
        numel_out = batch_size * self.seq_len * self.d_model
        started = time.perf_counter()
        try:
            result = await self.client.exchange(
                peer_id,
                rpc="forward",
                stage=stage,
                microbatch_id=microbatch_id,
                batch_size=batch_size,
                tensors=list(asked.request),
                timeout_s=self.timeouts.timeout_s(stage, "forward"),
                response_codec=CodecChoice(codec, dict(params)),
                max_answer_bytes=answer_bytes_limit(numel_out),
            )
            check_answer(
                peer_id,
                stage,
                "forward",
                num_stages=self.view.num_stages,
                expected_shape=(batch_size, self.seq_len, self.d_model),
                outputs=result.outputs,
                loss=result.response.loss,
            )
        except PeerCallError as e:
            self.metrics.observe_failure(stage=stage, rpc="forward", kind=e.kind.value)
            failed_at = time.perf_counter()
            self.service.finished(peer_id, started, failed_at)
            self._note_failure(stage, peer_id, e, failed_after_s=failed_at - started)
            return None
        done = time.perf_counter()
        service_s = self.service.finished(peer_id, started, done)
        self._note_success(
            stage, "forward", peer_id, batch_size, done - started, service_s, result.response, result.moved, False
        )
        return StageAnswer(
            result.outputs, result.response, peer_id, result.received, asked.received_codec, asked.request
        )

    def _note_success(
        self,
        stage: int,
        rpc: str,
        peer_id: str,
        batch_size: int,
        elapsed: float,
        service_s: float,
        response: ResponseHeader,
        moved: int,
        from_cache: bool,
    ) -> None:
        self.metrics.observe_call(stage=stage, rpc=rpc, duration_s=elapsed)
        # Routing trusts only what this trainer measured: the time the call kept the replica busy on
        # our own clock (swarm/trainer/service_clock.py), never the compute and queue times the
        # replica reports, which a replica could set to ~0 to draw nearly every call (issue #30).
        # A backward answered without its inputs was served from the activation cache (no recompute).
        task = "backward_cached" if from_cache else rpc
        self.view.schedulers[stage].report_success(peer_id, task, batch_size, service_s)
        # The codec choice may use the replica's own split of the call into compute and wire time:
        # a replica lying there can only change how our tensors to it are compressed.
        compute_s = min(max(response.compute_s, 0.0), elapsed)
        transfer_s = max(elapsed - max(response.queue_s, 0.0) - compute_s, 0.0)
        self.codecs.observe(
            peer_id, stage, nbytes=moved, transfer_s=transfer_s, compute_s=compute_s, batch_size=batch_size
        )
        self.timeouts.observe(stage, rpc, elapsed)
        self.view.bans.clear(peer_id)
        key = peer_id[-8:]
        self.counters.calls_by_peer[key] = self.counters.calls_by_peer.get(key, 0) + 1
        self.contributions.answered(peer_id, stage, rpc, batch_size)

    def _note_failure(self, stage: int, peer_id: str, error: PeerCallError, failed_after_s: float) -> None:
        self.view.schedulers[stage].report_failure(peer_id)
        self.counters.calls_retried += 1
        kind = error.kind.value
        self.counters.failures_by_kind[kind] = self.counters.failures_by_kind.get(kind, 0) + 1
        # A protocol violation is the peer's own doing, not bad luck: avoided for long. A wrong-stage
        # answer to a call routed by the peer's own record of this stage bans it on this stage (an
        # honest peer that moved serves its new one); a malformed answer bans it everywhere.
        self.contributions.failed(peer_id, stage)
        if error.kind == Failure.WRONG_STAGE:
            banned_s = self.view.violations.wrong_stage(peer_id, stage, str(error))
            logger.warning(f"stage {stage}: {error}; not routing stage {stage} there for {banned_s:.0f} s")
            self.contributions.banned(
                peer_id, stage, f"stage {stage}: {error} (not asked for stage {stage} for {banned_s:.0f} s)"
            )
        elif error.kind == Failure.GARBAGE:
            banned_s = self.view.violations.malformed(peer_id, str(error))
            logger.warning(f"stage {stage}: {error}; not routing anything there for {banned_s:.0f} s")
            self.contributions.banned(peer_id, stage, f"stage {stage}: {error} (not asked for {banned_s:.0f} s)")
        else:
            # Probing a peer again costs what this failure cost: keep that under a quarter of the time.
            self.view.bans.ban(peer_id, at_least_s=3.0 * failed_after_s)
        self.metrics.bans.labels(stage=str(stage)).inc()
        # Failover is routine (a stream reset, a peer that left): the retry is counted in the report and
        # the metrics; only a microbatch that runs out of retries is worth a warning (RetriesExhaustedError).
        logger.info(f"stage {stage}: {error}; retrying")

    def _my_peer_id(self) -> str:
        p2p = getattr(self.client, "p2p", None)
        return p2p.peer_id.to_base58() if p2p is not None else "(unknown)"

    async def _wait_for_replica(self, stage: int, since: float, budget: RetryBudget) -> None:
        """No replica can take this call now: refresh the peer list until one can, or give up."""
        waited = time.monotonic() - since
        if waited > self.stage_wait_timeout_s:
            raise StageUnavailableError(
                stage,
                f"no live replica for {waited:.0f} s (failed: "
                f"{sorted(p[-8:] for p in budget.failed_peers())}); start a peer "
                f"with --stage {stage} or raise --stage-wait-timeout-s",
            )
        bans = self.view.bans
        if int(waited) % 10 == 0:
            self._say(
                f"waiting for a live replica of stage {stage} ({waited:.0f} s so far; {len(bans.banned())} peers banned)"
            )
        next_unban = bans.seconds_until_next_unban()
        pause_s = min(1.0, next_unban if next_unban is not None else 1.0)
        await asyncio.sleep(pause_s)
        self.metrics.stage_wait.labels(stage=str(stage)).inc(pause_s)
        await self.view.refresh()


def check_answer(
    peer_id: str,
    stage: int,
    rpc: str,
    *,
    num_stages: int,
    expected_shape: tuple[int, int, int],
    outputs: dict[str, torch.Tensor],
    loss: float | None,
) -> None:
    """Refuse answers that break the contract: a peer returning garbage is treated as failed
    (`PeerCallError` of kind GARBAGE)."""
    is_last = stage == num_stages - 1
    name = "outputs" if rpc == "forward" else "grad_inputs"
    needs_tensor = not (rpc == "forward" and is_last) and not (rpc == "backward" and stage == 0)
    if needs_tensor:
        tensor = outputs.get(name)
        if tensor is None or tuple(tensor.shape) != expected_shape or tensor.dtype != torch.float32:
            got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            raise PeerCallError(peer_id, Failure.GARBAGE, f"expected {name} {expected_shape} float32, got {got}")
        if not torch.isfinite(tensor).all():
            raise PeerCallError(peer_id, Failure.GARBAGE, f"{name} contain NaN or inf")
    if is_last and (loss is None or not math.isfinite(loss)):
        raise PeerCallError(peer_id, Failure.GARBAGE, f"the last stage returned loss {loss}")
