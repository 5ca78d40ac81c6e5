"""One microbatch's call to one stage, with failover (hub routing).

`StageCaller.call` hands the trainer's call engine (swarm/trainer/call_engine.py, which direct
routing's chains share) a `StageWork`: pick a replica of the stage (the stage's `ReplicaScheduler`
in the `SwarmView`, swarm/trainer/discovery.py), encode what it sends with the codec that
replica's link calls for, send it through `StageClient.exchange` (swarm/trainer/client.py, which
sends encoded tensors and decodes the answer), and check the answer. The engine retries a failed
call on another replica (or asks the same one again: a backward lost in transit), by the rules of
wire/call_rules.py, and waits for the stage when no replica can take it.

`StageCaller.verify` is the spot check (issues #25, #59): a call's request sent again, as a float32
recompute, to a second replica, and to more when the answers differ; two that differ with no third
replica are a dispute, held until the step's commit (`settle_disputes`). The decisions (which call,
the tolerance, the minority, the third opinion) are pure: swarm/trainer/spot_checks.py.

Encoding lives here and only here. A `Payload` is a tensor together with the encodings made or
received of it so far, one per codec choice: each is made once (a retry, or the backward that
resends a forward's inputs, reuses it), and an encoding that came over the wire from one stage is
sent on to the next as it came (no decode + re-encode) when the next link uses the same codec.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from process.phase_times import PhaseTimes
from swarm.trainer.call_engine import Blame, CallEngine
from swarm.trainer.client import CallResult, PeerCallError, StageClient
from swarm.trainer.config import FailoverSettings
from swarm.trainer.discovery import SwarmView
from swarm.trainer.failures import StageUnavailableError
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.spot_checks import (
    CHECK_PRECISION,
    MAX_OPINIONS,
    Answer,
    CallSampler,
    Dispute,
    Verdict,
    comparable_replicas,
    difference,
    judge,
    least_contradicted,
    recompute_is_stale,
    third_opinion,
    unchecked_because,
)
from wire.call_rules import Attempts, penalty_for
from wire.compression import CodecChoice, EncodedTensor, ErrorFeedback
from wire.compression.policy import CodecPolicy
from wire.failures import Failure
from wire.protocol import GRAD_SAMPLE_SIZE, ResponseHeader
from wire.tensors import encode_tensor

logger = logging.getLogger(__name__)

MAX_HELD_DISPUTES = 256  # disputes held for a third opinion within a step, the latest kept
MAX_REPORTED_DISPUTES = 50  # unresolved disputes the report lists, the latest kept
# a checked call's kind, as the report counts it, and as a ban's reason names it
KIND_NAMES = {"forward": "forward", "backward": "backward", "last": "last stage's (loss and input gradient)"}


def codec_key(choice: CodecChoice) -> tuple:
    """What makes two encodings of one tensor the same: the codec and its parameters."""
    return choice.codec, tuple(sorted(choice.params.items()))


@dataclass
class Payload:
    """A tensor to send, and its encodings made or received so far (codec key -> encoding)."""

    tensor: torch.Tensor
    encodings: dict[tuple, EncodedTensor] = field(default_factory=dict)


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


@dataclass(frozen=True)
class _Check:
    """One spot check: the call checked, the request to resend, the answer under check."""

    stage: int
    call: str  # the rpc: "forward" or "backward" (the last stage's fused call is a backward)
    microbatch_id: str
    batch_size: int
    request: tuple[tuple[str, EncodedTensor], ...]
    answer: StageAnswer
    step: int

    @property
    def codec(self) -> str:
        return self.answer.received_codec[0]

    def kind(self, num_stages: int) -> str:
        """forward, backward, or last (the last stage's fused call)."""
        return "last" if self.call == "backward" and self.stage == num_stages - 1 else self.call


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
        self.engine = CallEngine(view, failover, say=say, my_peer_id=self._my_peer_id)  # shared with the chains
        # the engine's state, by the names the schedule, the chains and the checks use
        self.counters, self.contributions = self.engine.counters, self.engine.contributions
        self.timeouts, self.service, self.not_allowed_by = (
            self.engine.timeouts,
            self.engine.service,
            self.engine.not_allowed_by,
        )
        self.codecs = codecs or CodecPolicy("none")
        self.phases: PhaseTimes = getattr(client, "phases", None) or PhaseTimes()  # the trainer's, by phase
        self.feedback = ErrorFeedback()  # top-k gradient residuals, one per destination stage
        self.spot_checks = CallSampler(verify_fraction, seed=seed)  # which calls to check
        self.told_unchecked: set[str] = set()  # replicas whose answers cannot be compared, told once
        # disputes (two answers apart, no third replica to ask) held for a third opinion within their step
        self.held: list[tuple[Dispute, _Check, dict[str, StageAnswer]]] = []
        self.disputes_unresolved: list[Dispute] = []  # ... and those none could settle, the latest
        # several trainers share the run's steps: another's commit may step the replicas between a
        # call and its check (the schedule sets it), and the steps each replica answered our last
        # commit with, which no answer to a later call may claim less than (`recompute_is_stale`)
        self.steps_may_move = False
        self.steps_committed: dict[tuple[int, str], int] = {}  # (stage, peer id) -> steps
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
                with self.phases.timed("encode"):
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
        work = StageWork(self, stage, rpc, microbatch_id, batch_size, tensors, cached_on=cached_on, evaluate=evaluate)
        return await self.engine.drive(work, [] if failures is None else failures)

    async def verify(
        self,
        stage: int,
        microbatch_id: str,
        batch_size: int,
        answer: StageAnswer,
        *,
        call: str = "forward",
        request: tuple[tuple[str, EncodedTensor], ...] | None = None,
        step: int = 0,
    ) -> StageAnswer:
        """Spot-check `answer` to a `call` ("forward", or "backward": on the last stage its fused
        call): send its request (`request`, default the answer's own: every tensor the replica computed
        on, as sent) to another replica of the stage as a float32 recompute, and to a third when the
        two answers differ beyond the tolerance, and on while they settle nothing, up to MAX_OPINIONS
        answers (swarm/trainer/spot_checks.py). The replicas in the minority are banned for the run; two answers that differ with no third replica to ask
        are a dispute, held until one can be asked (`settle_disputes`). Returns the answer to go on
        with: `answer`, unless its replica was in the minority. Without another replica (or when the
        other fails) the call stays unverified; failures of the extra calls are noted like any other."""
        check = _Check(stage, call, microbatch_id, batch_size, tuple(request or answer.request), answer, step)
        by_peer = {answer.peer_id: answer}
        second = await self._ask_another(check, avoid=set(by_peer))
        if second is None or self._stale(check, second):  # nobody to compare with: unverified
            return answer
        by_peer[second.peer_id] = second
        verdict = self._judge(check, by_peer)
        self.counters.calls_verified += 1
        kind = check.kind(self.view.num_stages)
        self.counters.calls_verified_by_call[kind] = self.counters.calls_verified_by_call.get(kind, 0) + 1
        self.metrics.calls_verified.labels(stage=str(stage)).inc()
        if verdict.agreed:
            self.contributions.verified(stage, by_peer, agreed=True, checked=answer.peer_id, samples=batch_size)
            return answer
        self.counters.verify_mismatches += 1
        self.metrics.verify_mismatches.labels(stage=str(stage)).inc()
        while not verdict.decided and len(by_peer) < MAX_OPINIONS:  # more opinions until a majority shows
            another = await self._ask_another(check, avoid=set(by_peer), least_contradicted_first=True)
            if another is None or self._stale(check, another):
                break
            by_peer[another.peer_id] = another
            verdict = self._judge(check, by_peer)
            self.counters.verify_third_opinions += 1
        if len(by_peer) == 2:  # nobody to ask yet: held, asked later if a third can answer (settle_disputes)
            share, _ = difference(*(self._compared(check, a) for a in by_peer.values()), check.codec)
            dispute = Dispute(stage, kind, microbatch_id, (answer.peer_id, second.peer_id), share, step)
            self._hold(dispute, check, by_peer)
            return answer
        return by_peer[self._settle(check, by_peer, verdict)]

    def _stale(self, check: _Check, recompute: StageAnswer) -> bool:
        """Whether `recompute` came after the replicas stepped past the checked answer's step (another
        trainer committed in between): not compared, counted."""
        checked = check.answer
        stale = recompute_is_stale(
            checked.response.steps_done,
            recompute.response.steps_done,
            steps_may_move=self.steps_may_move,
            floor=self.steps_committed.get((check.stage, checked.peer_id), 0),
        )
        if stale:
            self.counters.verify_stale += 1
            self.metrics.verify_stale.labels(stage=str(check.stage)).inc()
            logger.debug(
                f"stage {check.stage}: {check.microbatch_id} not compared: {checked.peer_id[-8:]} computed it at "
                f"{checked.response.steps_done} steps, {recompute.peer_id[-8:]} recomputed it at "
                f"{recompute.response.steps_done}"
            )
        return stale

    def _judge(self, check: _Check, by_peer: dict[str, StageAnswer]) -> Verdict:
        verdict = judge({p: self._compared(check, a) for p, a in by_peer.items()}, check.codec)
        counters = self.counters
        if verdict.largest_agreeing_share > counters.verify_largest_agreeing_share:
            counters.verify_largest_agreeing_share = verdict.largest_agreeing_share
            counters.verify_largest_agreeing_difference = verdict.largest_agreeing_difference
        return verdict

    def _settle(self, check: _Check, by_peer: dict[str, StageAnswer], verdict: Verdict) -> str:
        """Three answers judged: the minority banned for the run, each counted; the replica trusted."""
        stage, kind = check.stage, check.kind(self.view.num_stages)
        majority = set(by_peer) - set(verdict.minority) if verdict.minority else set()
        self.contributions.verified(
            stage,
            by_peer,
            agreed=verdict.agreed,
            majority=majority,
            checked=check.answer.peer_id,
            samples=check.batch_size,
        )
        for peer_id in verdict.minority:
            if peer_id in self.counters.banned_peers:  # caught by a check in flight at the same time
                continue
            reason = (
                f"stage {stage}: its {KIND_NAMES[kind]} answer to {check.microbatch_id} differed from "
                f"{len(majority)} agreeing replicas' beyond the tolerance ({check.codec} codec)"
            )
            self.view.violations.lied(peer_id, reason)
            self.counters.banned_peers[peer_id] = reason
            self.contributions.banned(peer_id, stage, reason)
            self.metrics.verify_bans.labels(stage=str(stage)).inc()
            logger.warning(f"{reason}; banned {peer_id[-8:]} for the run")
        if not verdict.decided:
            self.counters.verify_undecided += 1
            logger.warning(
                f"stage {stage}: replicas {sorted(p[-8:] for p in by_peer)} answered {check.microbatch_id} "
                f"differently and no replica is in the minority; nobody banned"
            )
        return verdict.trusted

    def _hold(self, dispute: Dispute, check: _Check, by_peer: dict[str, StageAnswer]) -> None:
        """Two answers that disagree, nobody to ask: each counts a dispute; kept for a third opinion."""
        self.counters.verify_disputes += 1
        self.metrics.verify_disputes.labels(stage=str(check.stage)).inc()
        self.contributions.disputed(check.stage, dispute.peers)
        self.held.append((dispute, check, dict(by_peer)))
        del self.held[:-MAX_HELD_DISPUTES]
        logger.warning(
            f"stage {check.stage}: replicas {dispute.peers[0][-8:]} and {dispute.peers[1][-8:]} answered the "
            f"{KIND_NAMES[dispute.call]} call {check.microbatch_id} differently ({dispute.share:.1f}x the "
            f"tolerance) and no third replica can tell which is right yet: held, nobody banned"
        )

    async def settle_disputes(self, step: int) -> None:
        """Before the replicas step past `step`: each dispute held from it asked of a third replica
        that can answer now (one joined, or came back), and judged; the rest reported unresolved."""
        held, self.held = self.held, []
        for dispute, check, by_peer in held:
            third = None
            if dispute.step == step:
                excluded = self.engine.excluded(check.stage)
                candidates = self._comparable(check.stage, check.answer.peer_id)
                if third_opinion(dispute, candidates, excluded, step) is not None:
                    third = await self._ask_another(check, avoid=set(by_peer), least_contradicted_first=True)
                    if third is not None and self._stale(check, third):
                        third = None
            if third is None:  # nobody could tell: a mismatch for each of the two
                self.contributions.verified(check.stage, by_peer, agreed=False)
                self.counters.verify_disputes_unresolved += 1
                self.disputes_unresolved.append(dispute)
                del self.disputes_unresolved[:-MAX_REPORTED_DISPUTES]
                continue
            by_peer[third.peer_id] = third
            self.counters.verify_third_opinions += 1
            self.counters.verify_disputes_settled += 1
            self._settle(check, by_peer, self._judge(check, by_peer))

    def _compared(self, check: _Check, answer: StageAnswer) -> Answer:
        """What a check compares of `answer`: the components of its call, computed in the precision
        its replica announced (the pipeline's call), or in the check's (a recompute)."""
        components: dict[str, torch.Tensor] = {}
        for name in ("outputs", "grad_inputs"):
            if name in answer.outputs:
                components[name] = answer.outputs[name]
        if check.call == "backward":
            if answer.response.loss is not None:
                components["loss"] = torch.tensor(float(answer.response.loss), dtype=torch.float64)
            if answer.response.grad_sample is not None:
                components["grad_sample"] = torch.tensor(answer.response.grad_sample, dtype=torch.float64)
        if answer is check.answer:
            record = next((r for r in self.view.records[check.stage] if r.peer_id == answer.peer_id), None)
            return Answer(components, record.precision if record is not None else "fp32")
        return Answer(components, CHECK_PRECISION)

    def _comparable(self, stage: int, first: str) -> set[str]:
        records = self.view.records[stage]
        averaging = {r.peer_id: r.averaging for r in records}
        unchecked = {r.peer_id: unchecked_because(r.precision, r.weight_prediction) for r in records}
        reason = unchecked.get(first)
        if reason is not None and first not in self.told_unchecked:
            self.told_unchecked.add(first)
            logger.warning(f"stage {stage}: replica {first[-8:]} {reason}: its answers are not spot-checked")
        return comparable_replicas(first, averaging, self.view.averaging_members(stage), unchecked)

    async def _ask_another(
        self, check: _Check, avoid: set[str], *, least_contradicted_first: bool = False
    ) -> StageAnswer | None:
        """`check`'s request (the same encoded tensors, the same answer codec), as a float32 recompute,
        to one replica of its stage outside `avoid` that averages in sync with the checked one's, among
        those checks contradicted least when `least_contradicted_first` (a further opinion); None
        when none can take it or it fails (no retry: a spot check is an extra, not a call the pipeline
        needs)."""
        stage, batch_size = check.stage, check.batch_size
        scheduler = self.view.schedulers[stage]
        comparable = self._comparable(stage, check.answer.peer_id)
        exclude = self.engine.excluded(stage) | avoid
        exclude |= set(scheduler.keys_s()) - comparable
        exclude |= self.view.newcomers[stage].excluded(set(scheduler.keys_s()) - exclude)
        if least_contradicted_first:
            candidates = set(scheduler.keys_s()) - exclude
            exclude |= candidates - least_contradicted(candidates, self.contributions.check_records(candidates))
        peer_id = scheduler.choose(check.call, batch_size, exclude=exclude)
        if peer_id is None:
            return None
        self.view.newcomers[stage].called(peer_id)  # counts against the newcomers' share like any call
        self.counters.verify_calls += 1
        codec, params = check.answer.received_codec
        numel_out = batch_size * self.seq_len * self.d_model
        started = time.perf_counter()
        try:
            result = await self.client.exchange(
                peer_id,
                rpc=check.call,
                stage=stage,
                microbatch_id=check.microbatch_id,
                batch_size=batch_size,
                tensors=list(check.request),
                timeout_s=self.timeouts.timeout_s(stage, check.call),
                response_codec=CodecChoice(codec, dict(params)),
                max_answer_bytes=answer_bytes_limit(numel_out),
                grad_sample=check.call == "backward",
                check_precision=CHECK_PRECISION,
            )
            check_answer(
                peer_id,
                stage,
                check.call,
                num_stages=self.view.num_stages,
                expected_shape=(batch_size, self.seq_len, self.d_model),
                outputs=result.outputs,
                loss=result.response.loss,
                grad_sample=result.response.grad_sample if check.call == "backward" else (),
            )
        except PeerCallError as e:
            self.engine.note_failure(check.call, self.failed_call(stage, peer_id, e, started, time.perf_counter()))
            self.counters.calls_retried += 1
            return None
        done = time.perf_counter()
        self.timeouts.observe(stage, check.call, done - started)
        self.metrics.observe_call(stage=stage, rpc=check.call, duration_s=done - started)
        # a recompute: the replica's routing measure and link timing as for any call; no sample served
        self.answered_call(
            stage, check.call, peer_id, batch_size, result, started, done, from_cache=False, served=False
        )
        return StageAnswer(
            result.outputs, result.response, peer_id, result.received, check.answer.received_codec, check.request
        )

    def answered_call(
        self,
        stage: int,
        rpc: str,
        peer_id: str,
        batch_size: int,
        result: CallResult,
        started: float,
        done: float,
        *,
        from_cache: bool,
        served: bool = True,
    ) -> None:
        """A replica's answer, settled: its routing measure, its link's timing, the counters (not
        `served`: a spot check's recompute, which trains nothing)."""
        service_s = self.service.finished(peer_id, started, done)
        elapsed, response = done - started, result.response
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
            peer_id, stage, nbytes=result.moved, transfer_s=transfer_s, compute_s=compute_s, batch_size=batch_size
        )
        self.engine.note_answered(peer_id, stage, rpc if served else "check", batch_size)
        busy = response.busy
        self.contributions.busy(peer_id, stage, None if busy is None else (busy.busy_s, busy.clock_s))

    def failed_call(self, stage: int, peer_id: str, error: PeerCallError, started: float, done: float) -> list[Blame]:
        """A replica's failed call, settled; whom it blames: that replica, seen failing by this trainer."""
        self.service.finished(peer_id, started, done)
        self.view.schedulers[stage].report_failure(peer_id)
        penalty = penalty_for(error.kind, str(error), witnessed=True)
        # Probing a peer again costs what this failure cost: keep that under a quarter of the time.
        return [Blame(peer_id, stage, error.kind, penalty, str(error), at_least_s=3.0 * (done - started))]

    def _my_peer_id(self) -> str:
        p2p = getattr(self.client, "p2p", None)
        return p2p.peer_id.to_base58() if p2p is not None else "(unknown)"


@dataclass
class _Asked:
    """One attempt of a `StageWork`: the replica, and what was sent to it."""

    peer_id: str
    again: bool  # asked again after its answer was lost (charged, not chosen)
    skip_inputs: bool = False  # a backward sent without its inputs (the replica cached them)
    encoded: tuple[tuple[str, EncodedTensor], ...] = ()
    response_codec: CodecChoice | None = None


class StageWork:
    """One microbatch's call to one stage, as the call engine drives it (swarm/trainer/call_engine.py)."""

    waits_on_others = False  # a replica answers a hub call by itself

    def __init__(
        self,
        caller: StageCaller,
        stage: int,
        rpc: str,
        microbatch_id: str,
        batch_size: int,
        tensors: list[tuple[str, Payload]],
        *,
        cached_on: str | None,
        evaluate: bool,
    ):
        self.caller, self.stage, self.rpc = caller, stage, rpc
        self.microbatch_id, self.batch_size, self.tensors = microbatch_id, batch_size, tensors
        self.cached_on, self.evaluate = cached_on, evaluate
        self.timeout_key = (stage, rpc)
        self.adds_work = rpc == "backward"  # its gradients are added: a lost answer is asked again first
        self.waiting_for = f"a live replica of stage {stage}"
        self.numel_out = batch_size * caller.seq_len * caller.d_model
        # a run that spot-checks asks every backward for its gradient sample (not only those checked)
        self.wants_sample = rpc == "backward" and not evaluate and caller.spot_checks.fraction > 0.0

    def choose(self, exclude) -> _Asked | None:
        view = self.caller.view
        scheduler, newcomers = view.schedulers[self.stage], view.newcomers[self.stage]
        excluded = exclude(self.stage)
        excluded |= newcomers.excluded(set(scheduler.keys_s()) - excluded)
        cached_on = self.cached_on if self.rpc == "backward" else None
        peer_id = scheduler.choose(self.rpc, self.batch_size, exclude=excluded, cached_on=cached_on)
        return None if peer_id is None else _Asked(peer_id, again=False)

    def again(self, peer_id: str) -> _Asked | None:
        # charged like any call, so its answer settles its own charge
        if not self.caller.view.schedulers[self.stage].charge(peer_id, self.rpc, self.batch_size):
            return None
        return _Asked(peer_id, again=True)

    def key(self, target: _Asked) -> str:
        return target.peer_id

    def expected_s(self, target: _Asked) -> float | None:
        return self.caller.view.schedulers[self.stage].expected_s(target.peer_id, self.rpc, self.batch_size)

    def replicas(self, target: _Asked) -> list[tuple[int, str]]:
        return [(self.stage, target.peer_id)]

    async def call(self, target: _Asked, timeout_s: float) -> CallResult:
        caller, peer_id, stage, rpc = self.caller, target.peer_id, self.stage, self.rpc
        caller.view.newcomers[stage].called(peer_id)
        # the peer that served the forward cached its inputs (and token ids): not sent again
        # (not when asked again: the failed call took them out of the cache)
        skip_inputs = (
            rpc == "backward"
            and peer_id == self.cached_on
            and not target.again
            and any(n == "inputs" for n, _ in self.tensors)
        )
        response_codec = caller.codecs.choose(
            peer_id, stage, self.numel_out, self.batch_size, is_gradient=rpc == "backward"
        )
        while True:
            sent = [(n, t) for n, t in self.tensors if not (skip_inputs and n in ("inputs", "tokens"))]
            encoded = caller._encode(peer_id, stage, self.batch_size, sent)
            called = time.perf_counter()
            try:
                result = await caller.client.exchange(
                    peer_id,
                    rpc=rpc,
                    stage=stage,
                    microbatch_id=self.microbatch_id,
                    batch_size=self.batch_size,
                    tensors=encoded,
                    timeout_s=timeout_s,
                    response_codec=response_codec,
                    inputs_cached=skip_inputs,
                    evaluate=self.evaluate,
                    max_answer_bytes=answer_bytes_limit(self.numel_out),
                    grad_sample=self.wants_sample,
                )
                caller.phases.add("call", time.perf_counter() - called)
                break
            except PeerCallError as e:
                # A cache miss (or an older peer refusing a request without inputs) is no
                # failure of the peer: ask it again, with the inputs this time.
                if not (skip_inputs and e.kind in (Failure.CACHE_MISS, Failure.REFUSED)):
                    raise
                skip_inputs = False
                caller.counters.backward_inputs_resent += 1
        check_answer(
            peer_id,
            stage,
            rpc,
            num_stages=caller.view.num_stages,
            expected_shape=(self.batch_size, caller.seq_len, caller.d_model),
            outputs=result.outputs,
            loss=result.response.loss,
            grad_sample=result.response.grad_sample if self.wants_sample else (),
        )
        if skip_inputs:
            caller.counters.backward_inputs_skipped += 1
        target.skip_inputs, target.encoded, target.response_codec = skip_inputs, tuple(encoded), response_codec
        return result

    def failed(self, target: _Asked, error: PeerCallError, started: float, done: float) -> list[Blame]:
        return self.caller.failed_call(self.stage, target.peer_id, error, started, done)

    def answered(self, target: _Asked, result: CallResult, started: float, done: float) -> StageAnswer:
        self.caller.answered_call(
            self.stage, self.rpc, target.peer_id, self.batch_size, result, started, done, from_cache=target.skip_inputs
        )
        return StageAnswer(
            result.outputs,
            result.response,
            target.peer_id,
            result.received,
            codec_key(target.response_codec),
            target.encoded,
        )

    def unavailable(self, waited_s: float, attempts: Attempts) -> StageUnavailableError:
        return StageUnavailableError(
            self.stage,
            f"no live replica for {waited_s:.0f} s (failed: {sorted(p[-8:] for p in attempts.failed_peers())}); "
            f"start a peer with --stage {self.stage} or raise --stage-wait-timeout-s",
        )


def check_answer(
    peer_id: str,
    stage: int,
    rpc: str,
    *,
    num_stages: int,
    expected_shape: tuple[int, int, int],
    outputs: dict[str, torch.Tensor],
    loss: float | None,
    grad_sample: list[float] | None | tuple = (),
) -> None:
    """Refuse answers that break the contract: a peer returning garbage is treated as failed
    (`PeerCallError` of kind GARBAGE). `grad_sample`: the answer's gradient sample when one was
    asked for (None: missing; the default `()`: none asked)."""
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
    if grad_sample != ():
        if grad_sample is None or not 0 < len(grad_sample) <= GRAD_SAMPLE_SIZE:
            got = None if grad_sample is None else f"{len(grad_sample)} entries"
            raise PeerCallError(peer_id, Failure.GARBAGE, f"expected a gradient sample, got {got}")
        if not all(math.isfinite(v) for v in grad_sample):
            raise PeerCallError(peer_id, Failure.GARBAGE, "the gradient sample holds NaN or inf")
