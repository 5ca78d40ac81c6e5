"""The trainer's async layer: stream microbatches through the stages, one replica per stage per
call chosen by stochastic wiring, with failover. Nothing is dropped: a failed call is retried on
another replica, and a stage with no live replica is waited for (visibly) until it returns or
`stage_wait_timeout_s` runs out, which stops the run with an error instead of losing data.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import hivemind
import torch

from dht.announce import fetch_stage_records_async
from dht.records import PeerRecord, PeerState
from swarm.trainer.client import PeerCallError, StageClient
from swarm.trainer.codec_policy import CodecPolicy
from swarm.trainer.data import Microbatch
from swarm.trainer.failures import BanList, RetriesExhaustedError, RetryBudget, StageUnavailableError, TimeoutPolicy
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.routing import ReplicaInfo, ReplicaScheduler
from wire.compression import CodecChoice, EncodedTensor, ErrorFeedback
from wire.failures import Failure
from wire.protocol import ResponseHeader
from wire.tensors import encode_tensor

logger = logging.getLogger(__name__)


@dataclass
class PipelineCounters:
    microbatches_sent: int = 0
    microbatches_done: int = 0
    calls_retried: int = 0
    microbatches_retried: int = 0  # microbatches that needed at least one retry
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    calls_by_peer: dict[str, int] = field(default_factory=dict)
    commits: int = 0  # replicas that stepped on our commit (sync, or periodic every K steps)
    averaged_commits: int = 0  # ... of which averaged with other replicas
    backward_inputs_skipped: int = 0  # backwards answered from the peer's activation cache, inputs not resent
    backward_inputs_resent: int = 0  # ... tried without inputs, but the peer had no cached forward


@dataclass(frozen=True)
class StageAnswer:
    outputs: dict[str, torch.Tensor]
    response: ResponseHeader
    peer_id: str  # the replica that answered
    received: dict[str, dict[tuple, EncodedTensor]]  # name -> {codec key: the tensor as it came over the wire}


def _choice_key(choice: CodecChoice) -> tuple:
    return choice.codec, tuple(sorted(choice.params.items()))


def _passed_on(received: dict[str, dict[tuple, EncodedTensor]], name: str, as_name: str) -> dict:
    """An `_encode` cache that sends the tensor `name` on, as `as_name`, in the encoding it came in."""
    return {(as_name, *key): item for key, item in received.get(name, {}).items()}


class SwarmPipeline:
    def __init__(
        self,
        dht: hivemind.DHT,
        client: StageClient,
        *,
        model: str,
        num_stages: int,
        d_model: int,
        seq_len: int,
        max_retries: int,
        stage_wait_timeout_s: float,
        max_in_flight: int,
        run_id: str,
        codecs: CodecPolicy | None = None,
        on_wait=print,
        metrics: TrainerMetrics | None = None,
    ):
        self.dht, self.client, self.model, self.num_stages = dht, client, model, num_stages
        self.d_model, self.seq_len = d_model, seq_len
        self.max_retries, self.stage_wait_timeout_s = max_retries, stage_wait_timeout_s
        self.run_id = run_id
        self.codecs = codecs or CodecPolicy("none")
        self.feedback = ErrorFeedback()  # top-k gradient residuals, one per destination stage
        self.schedulers = [ReplicaScheduler() for _ in range(num_stages)]
        self.timeouts = TimeoutPolicy()
        # A short base ban: a replica refused at once (killed, or a dropped stream) is cheap to probe
        # again, and a stage whose only replica had a glitch must not stall for 15 s; a call that failed
        # slowly (a timeout) is banned at least 3x as long as it took (see _note_failure).
        self.bans = BanList(base_s=1.0, max_s=60.0)
        self.records: list[list[PeerRecord]] = [[] for _ in range(num_stages)]
        self.counters = PipelineCounters()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._refreshed = asyncio.Event()
        self.refreshes = 0
        self._on_wait = on_wait
        self.metrics = metrics or TrainerMetrics()

    # --- discovery -------------------------------------------------------------------------------
    async def refresh(self) -> None:
        results = await asyncio.gather(
            *[fetch_stage_records_async(self.dht, self.model, s) for s in range(self.num_stages)]
        )
        for stage, records in enumerate(results):
            online = [r for r in records if r.state == PeerState.ONLINE and r.num_stages == self.num_stages]
            known, now = {r.peer_id for r in self.records[stage]}, {r.peer_id for r in online}
            if self.refreshes and known != now:  # not on the first refresh: that is the start
                joined, left = sorted(p[-8:] for p in now - known), sorted(p[-8:] for p in known - now)
                self._on_wait(
                    f"stage {stage}: {len(now)} replicas"
                    + (f"; joined {', '.join(joined)}" if joined else "")
                    + (f"; left {', '.join(left)}" if left else "")
                )
            self.records[stage] = online
            self.schedulers[stage].update_replicas([ReplicaInfo(r.peer_id, r.throughput) for r in online])
        self.metrics.set_stages(self.live_replicas(), [sum(r.throughput for r in rs) for rs in self.records])
        self.refreshes += 1
        self._refreshed.set()

    async def refresh_forever(self, period_s: float) -> None:
        """Refresh every `period_s` seconds from start to start, so that a slow DHT lookup (a loaded
        machine) does not stretch the period in which a new peer is discovered."""
        next_s = time.monotonic() + period_s
        while True:
            await asyncio.sleep(max(next_s - time.monotonic(), 0.0))
            next_s = max(next_s + period_s, time.monotonic())
            try:
                await self.refresh()
            except Exception as e:  # the DHT may hiccup; the next refresh tries again
                logger.warning(f"Refreshing the peer list failed: {e}")

    def live_replicas(self) -> list[int]:
        return [len(records) for records in self.records]

    # --- one call, with failover -----------------------------------------------------------------
    def _encode(
        self, peer_id: str, stage: int, batch_size: int, tensors: list[tuple[str, torch.Tensor]], cache: dict
    ) -> list[tuple[str, EncodedTensor]]:
        """Encode what goes to `peer_id` with the codec its link calls for, once per codec choice:
        `cache` maps (name, codec, params) to an encoding, and may come pre-filled with the
        encoding a tensor arrived in, which is then passed on as it is (no decode + re-encode)."""
        encoded = []
        for name, tensor in tensors:
            choice = self.codecs.choose(peer_id, stage, tensor.numel(), batch_size, is_gradient=name == "grad_outputs")
            key = (name, *_choice_key(choice))
            if key not in cache:
                feedback = self.feedback if name == "grad_outputs" and choice.codec == "topk" else None
                cache[key] = encode_tensor(tensor, choice.codec, choice.params, feedback=feedback, feedback_key=stage)
            encoded.append((name, cache[key]))
        return encoded

    async def call_stage(
        self,
        stage: int,
        rpc: str,
        microbatch_id: str,
        batch_size: int,
        tensors: list[tuple[str, torch.Tensor]],
        failures: list[str] | None = None,
        *,
        encoded: dict | None = None,
        cached_on: str | None = None,
    ) -> StageAnswer:
        """Call one replica of `stage`, failing over until one answers. Failed attempts are
        appended to `failures`. `encoded`: the encodings of `tensors` made so far (see `_encode`);
        filled in as the call encodes more. `cached_on` (backward): the peer that served this
        microbatch's forward on this stage; if it is chosen again, the inputs are not resent (it
        answers a cache miss if it no longer holds them, and they are then sent)."""
        failures = [] if failures is None else failures
        encoded_cache: dict = {} if encoded is None else encoded
        numel_out = batch_size * self.seq_len * self.d_model
        budget = RetryBudget(stage, max_retries=self.max_retries)
        waited_since = None
        while True:
            peer_id = self.schedulers[stage].choose(
                rpc,
                batch_size,
                exclude=self.bans.banned() | budget.failed_peers(),
                cached_on=cached_on if rpc == "backward" else None,
            )
            if peer_id is None:
                waited_since = waited_since or time.monotonic()
                await self._wait_for_replica(stage, waited_since, budget)
                budget = RetryBudget(stage, max_retries=self.max_retries)
                continue
            waited_since = None
            timeout_s = self.timeouts.timeout_s(stage, rpc)
            started = time.perf_counter()
            skip_inputs = rpc == "backward" and peer_id == cached_on and any(n == "inputs" for n, _ in tensors)
            try:
                response_codec = self.codecs.choose(
                    peer_id, stage, numel_out, batch_size, is_gradient=rpc == "backward"
                )
                while True:
                    sent = [(n, t) for n, t in tensors if not (skip_inputs and n == "inputs")]
                    try:
                        result = await self.client.exchange(
                            peer_id,
                            rpc=rpc,
                            stage=stage,
                            microbatch_id=microbatch_id,
                            batch_size=batch_size,
                            tensors=self._encode(peer_id, stage, batch_size, sent, encoded_cache),
                            timeout_s=timeout_s,
                            response_codec=response_codec,
                            inputs_cached=skip_inputs,
                        )
                        break
                    except PeerCallError as e:
                        # A cache miss (or an older peer refusing a request without inputs) is no
                        # failure of the peer: ask it again, with the inputs this time.
                        if not (skip_inputs and e.kind in (Failure.CACHE_MISS, Failure.REFUSED)):
                            raise
                        skip_inputs = False
                        self.counters.backward_inputs_resent += 1
                self._check_outputs(peer_id, stage, rpc, batch_size, result.outputs, result.response.loss)
                if skip_inputs:
                    self.counters.backward_inputs_skipped += 1
                outputs, response, moved = result.outputs, result.response, result.moved
            except PeerCallError as e:
                self.metrics.observe_failure(stage=stage, rpc=rpc, kind=e.kind.value)
                self._note_failure(stage, peer_id, e, failed_after_s=time.perf_counter() - started)
                failures.append(str(e))
                try:
                    budget.record_failure(peer_id, str(e))
                except RetriesExhaustedError as exhausted:
                    logger.warning(str(exhausted))
                    waited_since = time.monotonic()
                    await self._wait_for_replica(stage, waited_since, budget)
                    budget = RetryBudget(stage, max_retries=self.max_retries)
                continue
            elapsed = time.perf_counter() - started
            self.metrics.observe_call(stage=stage, rpc=rpc, duration_s=elapsed)
            # A replica's throughput is set by its busier own resource: its compute thread, or its link
            # (the call minus what the peer spent queued and computing: wire time both ways and
            # (de)serialization). With several calls in flight the two overlap, so the larger one is the
            # bound, not their sum. Time queued behind our other requests says how much we sent, not how
            # fast the replica is: counting it made the busiest replica look slow.
            compute_s = min(max(response.compute_s, 0.0), elapsed)
            transfer_s = max(elapsed - max(response.queue_s, 0.0) - compute_s, 0.0)
            # A backward answered without its inputs was served from the activation cache (no recompute).
            task = "backward_cached" if skip_inputs else rpc
            self.schedulers[stage].report_success(peer_id, task, batch_size, max(compute_s, transfer_s))
            self.codecs.observe(
                peer_id, stage, nbytes=moved, transfer_s=transfer_s, compute_s=compute_s, batch_size=batch_size
            )
            self.timeouts.observe(stage, rpc, elapsed)
            self.bans.clear(peer_id)
            key = peer_id[-8:]
            self.counters.calls_by_peer[key] = self.counters.calls_by_peer.get(key, 0) + 1
            received = {name: {_choice_key(response_codec): item} for name, item in result.received.items()}
            return StageAnswer(outputs, response, peer_id, received)

    def _note_failure(self, stage: int, peer_id: str, error: PeerCallError, failed_after_s: float) -> None:
        self.schedulers[stage].report_failure(peer_id)
        self.counters.calls_retried += 1
        kind = error.kind.value
        self.counters.failures_by_kind[kind] = self.counters.failures_by_kind.get(kind, 0) + 1
        if error.kind == Failure.WRONG_STAGE:
            self._refreshed.clear()  # the peer moved: a refresh will drop it from this stage
        else:
            # Probing a peer again costs what this failure cost: keep that under a quarter of the time.
            self.bans.ban(peer_id, at_least_s=3.0 * failed_after_s)
            self.metrics.bans.labels(stage=str(stage)).inc()
        logger.warning(f"stage {stage}: {error}; retrying on another replica")

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
        if int(waited) % 10 == 0:
            self._on_wait(
                f"waiting for a live replica of stage {stage} ({waited:.0f} s so far; "
                f"{len(self.bans.banned())} peers banned)"
            )
        next_unban = self.bans.seconds_until_next_unban()
        pause_s = min(1.0, next_unban if next_unban is not None else 1.0)
        await asyncio.sleep(pause_s)
        self.metrics.stage_wait.labels(stage=str(stage)).inc(pause_s)
        await self.refresh()

    def _check_outputs(
        self, peer_id: str, stage: int, rpc: str, batch_size: int, outputs: dict[str, torch.Tensor], loss: float | None
    ) -> None:
        """Refuse answers that break the contract: a peer returning garbage is treated as failed."""
        expected = (batch_size, self.seq_len, self.d_model)
        is_last = stage == self.num_stages - 1
        name = "outputs" if rpc == "forward" else "grad_inputs"
        needs_tensor = not (rpc == "forward" and is_last) and not (rpc == "backward" and stage == 0)
        if needs_tensor:
            tensor = outputs.get(name)
            if tensor is None or tuple(tensor.shape) != expected or tensor.dtype != torch.float32:
                got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
                raise PeerCallError(peer_id, Failure.GARBAGE, f"expected {name} {expected} float32, got {got}")
            if not torch.isfinite(tensor).all():
                raise PeerCallError(peer_id, Failure.GARBAGE, f"{name} contain NaN or inf")
        if is_last and (loss is None or not math.isfinite(loss)):
            raise PeerCallError(peer_id, Failure.GARBAGE, f"the last stage returned loss {loss}")

    # --- one microbatch through every stage ------------------------------------------------------
    async def run_microbatch(self, mb: Microbatch) -> float:
        """Forward through stages 0..S-2, a fused forward+backward on the last stage (it owns the
        loss), then backward through S-2..0. Returns the microbatch's mean loss."""
        async with self._slots:
            microbatch_id = f"{self.run_id}:{mb.step}:{mb.index}"
            self.counters.microbatches_sent += 1
            failures: list[str] = []
            stage_inputs = [mb.inputs]
            encodings: list[dict] = [{}]  # per stage: its inputs' encodings, reused by its backward
            served_by: list[str] = []  # per stage: the peer that served the forward (and cached it)
            for stage in range(self.num_stages - 1):
                answer = await self.call_stage(
                    stage,
                    "forward",
                    microbatch_id,
                    mb.size,
                    [("inputs", stage_inputs[-1])],
                    failures,
                    encoded=encodings[stage],
                )
                stage_inputs.append(answer.outputs["outputs"])
                encodings.append(_passed_on(answer.received, "outputs", "inputs"))
                served_by.append(answer.peer_id)
            last = self.num_stages - 1
            answer = await self.call_stage(
                last,
                "backward",
                microbatch_id,
                mb.size,
                [("inputs", stage_inputs[last]), ("targets", mb.targets)],
                failures,
                encoded=encodings[last],
            )
            response = answer.response
            for stage in reversed(range(last)):
                grad_encodings = _passed_on(answer.received, "grad_inputs", "grad_outputs")
                tensors = [("inputs", stage_inputs[stage]), ("grad_outputs", answer.outputs.get("grad_inputs"))]
                answer = await self.call_stage(
                    stage,
                    "backward",
                    microbatch_id,
                    mb.size,
                    tensors,
                    failures,
                    encoded={**encodings[stage], **grad_encodings},
                    cached_on=served_by[stage],
                )
            self.counters.microbatches_done += 1
            self.metrics.microbatches.inc()
            if failures:
                self.counters.microbatches_retried += 1
                self.metrics.microbatches_retried.inc()
            return float(response.loss)

    async def run_step(self, microbatches: list[Microbatch]) -> float:
        """All microbatches of one optimizer step; returns the mean loss over their samples. Then,
        if replicas average in sync mode, tell them the step is over so they average and step."""
        losses = await asyncio.gather(*[self.run_microbatch(mb) for mb in microbatches])
        total = sum(mb.size for mb in microbatches)
        await self.commit_step(f"{self.run_id}:{microbatches[0].step}")
        return sum(loss * mb.size for loss, mb in zip(losses, microbatches)) / total

    async def commit_step(self, step_id: str, timeout_s: float = 120.0) -> None:
        """Commit the step on every averaging replica of every stage, all at once: sync replicas
        meet in one all-reduce per stage and step; periodic replicas that average every K steps
        step on the commit (and average after every K-th); periodic replicas on a period answer
        without doing anything. A replica that fails to commit is logged and banned; it will fall
        behind its stage's parameters, and periodic checks or a restart bring it back."""
        calls = []
        for stage, records in enumerate(self.records):
            for mode in ("sync", "periodic"):
                group = [r.peer_id for r in records if r.averaging == mode]
                calls += [
                    (
                        stage,
                        peer_id,
                        self.client.commit(
                            peer_id, stage=stage, step_id=step_id, group_size=len(group), timeout_s=timeout_s
                        ),
                    )
                    for peer_id in group
                ]
        if not calls:
            return
        results = await asyncio.gather(*[call for _, _, call in calls], return_exceptions=True)
        for (stage, peer_id, _), result in zip(calls, results):
            if isinstance(result, PeerCallError):
                logger.warning(f"stage {stage}: commit failed: {result}")
                self.bans.ban(peer_id)
            elif isinstance(result, BaseException):
                raise result
            elif result.stepped:
                self.counters.commits += 1
                if result.averaged:
                    self.counters.averaged_commits += 1
