"""The microbatch schedule of one optimizer step, and its commit.

`StepSchedule.run_step` streams a step's microbatches through the stages, at most `max_in_flight`
at once: each goes forward through stages 0..S-2, takes a fused forward+backward on the last stage
(which owns the loss), and goes backward through S-2..0, every call through `StageCaller`
(swarm/trainer/stage_call.py, which fails over); a fraction of the calls (forwards, the last
stage's, backwards) is spot-checked by a second replica's recompute (`StageCaller.verify`). With
`--routing direct` a microbatch is instead one chained call that the peers pass on stage to stage
(`ChainCaller`, swarm/trainer/chain_call.py), and a chain that answered has each stage's calls
spot-checked in the same fraction, from what the stage's neighbours say crossed its hops
(`ChainCaller.audit`). Disputes of a step's checks are settled before its commit. Nothing is dropped: a microbatch either finishes
or the run stops with the error that stopped it. Then the step is committed on the replicas that
average (sync, or periodic every K steps), so that they step together.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dht.records import PeerRecord
from swarm.trainer.chain_call import ChainCaller
from swarm.trainer.client import PeerCallError, StageClient
from swarm.trainer.config import DEFAULT_OUTER_COMMITS, DEFAULT_ROUTING
from swarm.trainer.data import Microbatch
from swarm.trainer.discovery import SwarmView
from swarm.trainer.global_step import HEARTBEAT_S, REFRESH_S, SharedProgress
from swarm.trainer.global_step import step_id as global_step_id
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.spot_checks import CACHED_BACKWARD_WEIGHT, CallSampler, calls_to_check, check_weight
from swarm.trainer.stage_call import Payload, StageCaller
from wire.compression import EncodedTensor
from wire.failures import Failure
from wire.protocol import MAX_FOLLOWING_PEERS, CommitResponse, FollowsCommit

logger = logging.getLogger(__name__)
ROUND_RETRIES = 2  # commits again of a stage whose sync round failed everywhere, before its gradients carry over


def round_failed(answers: dict[str, CommitResponse]) -> bool:
    """Whether a stage's sync replicas all answered without averaging or stepping: their round failed
    (a lone replica averages with nobody, and with no sample it has nothing to step on). Replicas
    with a one-step delay that started a new round (`pending`) carry a failed round's gradients into
    it themselves: nothing to commit again."""
    return len(answers) > 1 and not any(a.stepped or a.averaged or a.pending for a in answers.values())


def global_grad_norm(prepared: dict[int, dict[str, CommitResponse]]) -> float:
    """The step's gradient norm over every stage, from the replicas' answers to clipping's
    "prepare": each stage's replicas hold the same averaged gradient, so each stage counts once (its
    largest answer); a stage with nothing prepared (its round failed, or it had no sample) counts 0."""
    total = 0.0
    for answers in prepared.values():
        norms = [a.grad_norm_sq for a in answers.values() if a.grad_norm_sq is not None]
        total += max(norms, default=0.0)
    return math.sqrt(total)


def anything_prepared(prepared: dict[int, dict[str, CommitResponse]]) -> bool:
    """Whether some replica answered clipping's "prepare" with a gradient to step on."""
    return any(a.grad_norm_sq is not None for answers in prepared.values() for a in answers.values())


def clip_scale(norm: float, max_norm: float) -> float:
    """What every stage's gradient is multiplied by: min(1, max_norm / norm), as
    torch.nn.utils.clip_grad_norm_ computes it (1e-6 keeps a zero norm finite)."""
    return min(1.0, max_norm / (norm + 1e-6))


@dataclass(frozen=True)
class CatchUp:
    """A sync replica behind its stage's others, and how it catches up (`replicas_to_repair`)."""

    peer_id: str
    source: str  # a replica with the most steps, whose state it loads
    to_steps: int  # the source's step count when it answered
    drops_gradients: bool  # its accumulated gradients are in the source's update: drop them


MAX_STEPS_BETWEEN_COMMITS = 4  # a commit, its retries and clipping's apply each step a replica once at most


def plausible_steps(answers: dict[str, CommitResponse], seen: Mapping[str, int]) -> dict[str, CommitResponse]:
    """The answers whose step count this trainer can believe: a replica it saw at n steps at its last
    commit holds at most n + MAX_STEPS_BETWEEN_COMMITS now (a replica it never saw: any count). A
    replica that claims a million steps more would otherwise be every other replica's repair source
    (issue #60: the honest replica loaded a forged state, 1,000,020 steps)."""
    return {p: a for p, a in answers.items() if p not in seen or a.steps_done <= seen[p] + MAX_STEPS_BETWEEN_COMMITS}


def replicas_to_repair(answers: dict[str, CommitResponse]) -> list[CatchUp]:
    """The replicas of one sync averaging group that have taken fewer steps than another, by their
    answers to a commit. Replicas that take the same rounds take the same steps, so a replica behind
    missed a round others completed: it failed on its side only (it did not step while the source
    stepped after averaging in a round of every replica: its gradients are in the source's update),
    or it was not in the round (a smaller group formed without it, e.g. a replica that joined one
    step behind) or was left behind earlier, e.g. on the commit of a trainer that died before
    repairing it: then its gradients are its own, and kept. With several trainers an answer can
    predate a round that brought its replica level: the replica then does nothing (`CatchUp.to_steps`)."""
    if len(answers) < 2:
        return []
    most = max(a.steps_done for a in answers.values())
    ahead = sorted(p for p, a in answers.items() if a.steps_done == most)
    source = next((p for p in ahead if answers[p].stepped and answers[p].averaged), ahead[0])
    partial_round = answers[source].stepped and answers[source].averaged and answers[source].group_size >= len(answers)
    return [
        CatchUp(peer_id, source, most, drops_gradients=partial_round and not answer.stepped)
        for peer_id, answer in sorted(answers.items())
        if answer.steps_done < most
    ]


def backward_request(
    sent: tuple[tuple[str, EncodedTensor], ...], forward_sent: tuple[tuple[str, EncodedTensor], ...]
) -> tuple[tuple[str, EncodedTensor], ...]:
    """Everything a backward computed on, as sent: its own request, and when it was served from the
    replica's activation cache (sent without its inputs) the inputs and token ids its forward was sent."""
    names = {name for name, _ in sent}
    return tuple(item for item in forward_sent if item[0] not in names) + tuple(sent)


@dataclass(frozen=True)
class OuterCatchUp:
    """An outer-rounds replica whose anchor is not its group's (`outer_replicas_to_repair`)."""

    peer_id: str
    source: str  # the replica with the most rounds applied, whose state it loads
    rounds: int  # the rounds the source had applied when it answered


def outer_replicas_to_repair(answers: dict[str, CommitResponse]) -> list[OuterCatchUp]:
    """The replicas of one outer-rounds group whose anchor differs from that of the replica with the
    most rounds applied (ties: the anchor most of them hold, then the first peer id): a round that
    failed on one side only, or a joiner that missed the round in flight when it loaded its state."""
    if len(answers) < 2:
        return []
    holding: dict[str | None, int] = {}
    for answer in answers.values():
        holding[answer.anchor] = holding.get(answer.anchor, 0) + 1
    source = min(answers, key=lambda p: (-answers[p].outer_rounds, -holding[answers[p].anchor], p))
    ahead = answers[source]
    return [
        OuterCatchUp(peer_id, source, ahead.outer_rounds)
        for peer_id, answer in sorted(answers.items())
        if answer.anchor != ahead.anchor
    ]


def gloo_leader(records, group: list[str]) -> str | None:
    """Exact sync over gloo: the rendezvous of the group's first replica by peer id, when every one
    of them announces one (peers/replicas/gloo_allreduce.py); None: hivemind's averager."""
    addresses = {r.peer_id: r.gloo for r in records}
    if len(group) < 2 or not all(addresses.get(p) for p in group):
        return None
    return addresses[min(group)]


def exchange_group(records, group: list[str]) -> bool:
    """Exact sync by exchange: when every replica of the group announces it
    (peers/replicas/sync_exchange.py); otherwise gloo's rendezvous, or hivemind's averager."""
    takes = {r.peer_id: r.sync_exchange for r in records}
    return len(group) >= 2 and all(takes.get(p, False) for p in group)


def commit_groups(replicas: list[str], members: frozenset[str] | None) -> list[list[str]]:
    """A stage's replicas (in one averaging mode) in the groups they average in. With a run authority
    (`members`: its credentialed replicas) a replica outside it averages with no one (the members
    refuse it) and the members' group does not count it: counted, it would make them wait for a
    replica that never comes, at every commit."""
    if members is None:
        return [replicas]
    return [[p for p in replicas if p in members], *[[p] for p in replicas if p not in members]]


class StepSchedule:
    def __init__(
        self,
        caller: StageCaller,
        *,
        max_in_flight: int,
        run_id: str,
        routing: str = DEFAULT_ROUTING,
        send_tokens: bool = False,
        clip_grad_norm: float = 0.0,
        hub_timing_fraction: float = 0.0,
        seed: int = 0,
        outer_commits: str = DEFAULT_OUTER_COMMITS,
    ):
        self.caller, self.run_id = caller, run_id
        # > 0: each step's gradient is clipped to this global norm over every stage (two-phase commit)
        self.clip_grad_norm = clip_grad_norm
        # with clipping: each update's global gradient norm, before clipping (with --sync-delay 1 the
        # update applied at a commit is the previous step's)
        self.grad_norms: list[float] = []
        # a subspace model's later stages rebuild the residual stream from the token ids: send them along
        self.send_tokens = send_tokens
        # direct routing: each microbatch is one chained call through the stages (chain_call.py)
        self.chains = ChainCaller(caller) if routing == "direct" else None
        # ... except this fraction, sent through the trainer so that it times each stage's replicas itself
        self.hub_timed = CallSampler(hub_timing_fraction, seed=seed, purpose="hub-timing")
        self.view: SwarmView = caller.view
        self.client: StageClient = caller.client
        self.num_stages = self.view.num_stages
        self.counters = caller.counters  # the one set of counters, the calls' and the schedule's
        self.metrics: TrainerMetrics = caller.metrics
        self.max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight)
        self.checks_open = True  # False while a shared step is over but ours are in flight (`_check`)
        # samples each replica served (answered a backward for) in this step, by stage: the commit
        # caps each replica's weight in the sync average at its count
        self._served: dict[int, dict[str, int]] = {}
        # the steps each sync replica answered at the last commit, by stage: what a repair believes
        self._steps_seen: dict[int, dict[str, int]] = {}
        self._background: set[asyncio.Task] = set()  # commits of replicas that step alone, not waited for
        # "background": a step's commit of the outer-rounds replicas travels while the next step computes,
        # and that step's commit waits for it first (one in flight: a replica gets them in order)
        self.outer_commits = outer_commits
        self._outer_commit: asyncio.Task | None = None
        # replicas whose commit failed, by (stage, peer id): their record's expiry then; left out of the
        # commits until the record is renewed (a dead one's never is, until it expires)
        self._commit_failed: dict[tuple[int, str], float] = {}

    async def run_microbatch(self, mb: Microbatch) -> float:
        """Forward through stages 0..S-2, a fused forward+backward on the last stage (it owns the
        loss), then backward through S-2..0. Returns the microbatch's mean loss."""
        async with self._slots:
            microbatch_id = f"{self.run_id}:{mb.step}:{mb.index}"
            self.counters.microbatches_sent += 1
            failures: list[str] = []
            if self.chains is not None:
                if not self.hub_timed.pick():
                    return await self._chained(microbatch_id, mb, failures)
                self.counters.microbatches_hub_timed += 1  # --hub-timing-fraction: timed stage by stage below
            call = self.caller.call
            # Per stage: its inputs (their encodings are reused by its backward) and the peer that
            # served its forward (and cached it, so that the backward need not resend the inputs).
            stage_inputs = [Payload(mb.inputs)]
            served_by: list[str] = []
            forward_requests = []  # what each stage's forward was sent: a cached backward's inputs
            check = self._check  # --verify-fraction: a call picked is recomputed by a second replica too
            for stage in range(self.num_stages - 1):
                tensors = [("inputs", stage_inputs[-1]), *self._tokens(stage, stage_inputs[0])]
                answer = await call(stage, "forward", microbatch_id, mb.size, tensors, failures)
                if check():
                    answer = await self.caller.verify(stage, microbatch_id, mb.size, answer, step=mb.step)
                stage_inputs.append(answer.payload("outputs"))
                served_by.append(answer.peer_id)
                forward_requests.append(answer.request)
            last = self.num_stages - 1
            tensors = [("inputs", stage_inputs[last]), ("targets", Payload(mb.targets))]
            tensors += self._tokens(last, stage_inputs[0])
            answer = await call(last, "backward", microbatch_id, mb.size, tensors, failures)
            self._count_served(last, answer.peer_id, mb.size)
            if check():  # the last stage's fused call: its loss, input gradient and gradient sample
                answer = await self.caller.verify(last, microbatch_id, mb.size, answer, call="backward", step=mb.step)
            response = answer.response
            for stage in reversed(range(last)):
                tensors = [("inputs", stage_inputs[stage]), ("grad_outputs", answer.payload("grad_inputs"))]
                tensors += self._tokens(stage, stage_inputs[0])
                answer = await call(
                    stage, "backward", microbatch_id, mb.size, tensors, failures, cached_on=served_by[stage]
                )
                self._count_served(stage, answer.peer_id, mb.size)
                if check(CACHED_BACKWARD_WEIGHT):  # its input gradient and sample, from all it used
                    request = backward_request(answer.request, forward_requests[stage])
                    answer = await self.caller.verify(
                        stage, microbatch_id, mb.size, answer, call="backward", request=request, step=mb.step
                    )
            self._finished(failures)
            return float(response.loss)

    async def _chained(self, microbatch_id: str, mb: Microbatch, failures: list[str]) -> float:
        """Direct routing: the microbatch as one chained call, re-driven until it answers; counted once."""
        answer = await self.chains.run(microbatch_id, mb, failures)
        for stage, peer_id in enumerate(answer.served_by):
            self._count_served(stage, peer_id, mb.size)
        for stage, call in calls_to_check(self.num_stages):  # --verify-fraction: each call, as under hub routing
            if self._check(check_weight(stage, call, self.num_stages)):
                await self.chains.audit(stage, call, microbatch_id, mb, answer, send_tokens=self.send_tokens)
        self._finished(failures)
        return answer.loss

    def _check(self, weight: float = 1.0) -> bool:
        """Whether to spot-check the call at hand (`CallSampler.pick`, drawn for every call, so that the
        same run picks the same calls): not while the step is over for the run and another trainer
        may commit it, which would step the replicas between the call and its recompute."""
        picked = self.caller.spot_checks.pick(weight)
        return picked and self.checks_open

    def _tokens(self, stage: int, tokens: Payload) -> list[tuple[str, Payload]]:
        """The token ids as a named tensor for `stage`, where it needs them (never stage 0: they are its inputs)."""
        return [("tokens", tokens)] if self.send_tokens and stage > 0 else []

    def _finished(self, failures: list[str]) -> None:
        self.counters.microbatches_done += 1
        self.metrics.microbatches.inc()
        if failures:
            self.counters.microbatches_retried += 1
            self.metrics.microbatches_retried.inc()

    def _count_served(self, stage: int, peer_id: str, samples: int) -> None:
        served = self._served.setdefault(stage, {})
        served[peer_id] = served.get(peer_id, 0) + samples

    async def evaluate_microbatch(self, mb: Microbatch) -> float:
        """A validation forward through every stage (the last returns the loss); nothing is kept on
        the peers and nothing steps. Same failover as training. Returns the microbatch's mean loss."""
        async with self._slots:
            microbatch_id = f"{self.run_id}:eval:{-mb.step}:{mb.index}"
            payload, failures = Payload(mb.inputs), []
            tokens = payload
            for stage in range(self.num_stages):
                tensors = [("inputs", payload), *self._tokens(stage, tokens)]
                if stage == self.num_stages - 1:
                    tensors.append(("targets", Payload(mb.targets)))
                answer = await self.caller.call(
                    stage, "forward", microbatch_id, mb.size, tensors, failures, evaluate=True
                )
                if stage < self.num_stages - 1:
                    payload = answer.payload("outputs")
            return float(answer.response.loss)

    async def evaluate(self, batches: list[list[Microbatch]]) -> float:
        """The mean validation loss over every sample of `batches` (after the last step's commit)."""
        await self.outer_commit_done()
        microbatches = [mb for batch in batches for mb in batch]
        losses = await asyncio.gather(*[self.evaluate_microbatch(mb) for mb in microbatches])
        total = sum(mb.size for mb in microbatches)
        return sum(loss * mb.size for loss, mb in zip(losses, microbatches)) / total

    async def run_step(self, microbatches: list[Microbatch]) -> float:
        """All microbatches of one optimizer step; returns the mean loss over their samples. Then,
        if replicas average in sync mode, tell them the step is over so they average and step."""
        losses = await asyncio.gather(*[self.run_microbatch(mb) for mb in microbatches])
        total = sum(mb.size for mb in microbatches)
        committing = time.perf_counter()
        await self.commit_step(f"{self.run_id}:{microbatches[0].step}", outer_in_background=True)
        self.caller.phases.add("commit", time.perf_counter() - committing)
        return sum(loss * mb.size for loss, mb in zip(losses, microbatches)) / total

    async def run_shared_step(self, draw: Callable[[], Microbatch], progress: SharedProgress) -> tuple[float, int]:
        """This trainer's part of global step `progress.step` (swarm/trainer/global_step.py): draw and
        stream microbatches while the samples counted toward the step, with ours in flight, fall
        short of the batch; stop once the step is over (the batch is reached, or another trainer has
        moved on), let ours in flight finish, and commit the step under the run's shared id. Returns
        the mean loss over our samples and their number."""
        tasks: dict[asyncio.Task, Microbatch] = {}
        finished: list[tuple[float, int]] = []
        self.checks_open = True
        self.caller.steps_may_move = True  # another trainer may commit between a call and its check
        try:
            while not progress.status().over:
                if len(tasks) < self.max_in_flight and progress.may_send():
                    mb = draw()
                    tasks[asyncio.ensure_future(self.run_microbatch(mb))] = mb
                    progress.sent(mb.size)
                    continue
                progress.publish_soon(unless_within_s=HEARTBEAT_S)  # our claims, and a sign of life
                if tasks:
                    done, _ = await asyncio.wait(tasks, timeout=REFRESH_S, return_when=asyncio.FIRST_COMPLETED)
                else:
                    done = set()
                    await asyncio.sleep(REFRESH_S)
                for task in done:
                    mb = tasks.pop(task)
                    finished.append((task.result(), mb.size))
                    progress.note(mb.size, self._served)
                if done:
                    progress.publish_soon()
                await progress.refresh()
            # ours in flight finish (the replicas accumulate them into this step, or the next), unchecked:
            # another trainer may commit the step while they are in flight
            self.checks_open = False
            for task, mb in list(tasks.items()):
                finished.append((await task, mb.size))
                progress.note(mb.size, self._served)
                del tasks[task]
        finally:
            for task in tasks:
                task.cancel()
        await progress.published()
        await progress.publish()
        await progress.refresh(every_s=0.0)
        await self.commit_step(global_step_id(progress.run, progress.step), served=progress.caps())
        samples = sum(size for _, size in finished)
        return sum(loss * size for loss, size in finished) / max(samples, 1), samples

    async def flush(self, step_id: str, timeout_s: float = 120.0) -> None:
        """After the run's last step: sync replicas with a one-step delay apply the update still in
        flight (the others answer at once; one whose round failed averages again, itself); a
        replica that missed a round its partner completed is repaired, as after any step."""
        await self.commit_step(step_id, timeout_s, flush=True)

    async def commit_step(
        self,
        step_id: str,
        timeout_s: float = 120.0,
        *,
        flush: bool = False,
        served: dict[int, dict[str, int]] | None = None,
        outer_in_background: bool = False,
    ) -> None:
        """Commit the step on every averaging replica of every stage, all at once: sync replicas
        meet in one all-reduce per stage and step; periodic replicas that average every K steps
        step on the commit (and average after every K-th); periodic replicas on a period answer
        without doing anything. A replica that fails to commit is logged and banned; it will fall
        behind its stage's parameters, and periodic checks or a restart bring it back. A stage whose
        sync round failed on every replica (none stepped; their gradients stay accumulated) is
        committed again, up to ROUND_RETRIES times; one replica that missed a round its partner
        completed is repaired (`_repair_missed_rounds`). `served`: the weight caps, by stage and
        replica (default: what this trainer saw each replica serve since the last commit).
        `outer_in_background` (with `--outer-commits background`): the outer-rounds replicas' commit,
        and the repair of their anchors, go on while the next step computes (`outer_commit_done`)."""
        await self.outer_commit_done()
        own, self._served = self._served, {}
        served = own if served is None else served
        if self.caller.held and not flush:  # before the replicas step: this step's disputes, to a third replica
            await self.caller.settle_disputes(max(dispute.step for dispute, _, _ in self.caller.held))
        groups = [
            (stage, mode, group)
            for stage, records in enumerate(self.view.records)
            for mode in (("sync", "outer") if flush else ("sync", "periodic", "outer"))
            for group in commit_groups(
                [
                    r.peer_id
                    for r in records
                    if r.averaging == mode and not self._avoided(stage, r.peer_id) and not self._failed_since(stage, r)
                ],
                self.view.averaging_members(stage),
            )
        ]
        # Replicas outside every averaging group (no credential of the run) step alone: their commits
        # go out without the step waiting for them, so that one that stalls holds no step up.
        loners = [g for g in groups if self._steps_alone(*g)]
        groups = [g for g in groups if not self._steps_alone(*g)]
        if loners:
            self._commit_in_background(step_id, loners, served, timeout_s, flush=flush)
        if outer_in_background and self.outer_commits == "background" and not flush:
            outer_groups = [g for g in groups if g[1] == "outer" and g[2]]
            named = sorted({peer for _, _, group in outer_groups for peer in group})
            if outer_groups and len(named) <= MAX_FOLLOWING_PEERS:  # more: this step waits for them
                groups = [g for g in groups if not (g[1] == "outer" and g[2])]
                # the next step's calls name the commit: a replica it goes to handles it first
                self.client.follows_commit = FollowsCommit(step_id=step_id, peers=named)
                self._outer_commit = asyncio.ensure_future(self._commit_outer(step_id, outer_groups, served, timeout_s))
        sync_groups = [(stage, mode, group) for stage, mode, group in groups if mode == "sync" and group]
        # with a one-step delay the flush applies the last update: clipped like every other one
        clip = "prepare" if self.clip_grad_norm > 0 and sync_groups else None
        sync_answers = await self._commit(
            step_id, [g for g in groups if g[2]], served, timeout_s, flush=flush, clip_phase=clip
        )
        # each stage's averaging group (replicas outside it step alone, see commit_groups)
        averaging = {stage: group for stage, mode, group in groups if mode == "sync" and len(group) > 1}
        await self._repair_outer_groups(step_id, groups, sync_answers, timeout_s)
        if clip is None:  # with clipping nobody has stepped yet: the repair follows the second phase
            await self._repair_missed_rounds(step_id, averaging, sync_answers, timeout_s)
        if flush:  # replicas without a delay had nothing to do; delayed ones retried a failed round themselves
            if clip is not None:  # the last update, held by "prepare": applied clipped, then the repair
                repair_id, answers = step_id, sync_answers
                if anything_prepared(sync_answers):
                    repair_id = f"{step_id}:apply"
                    answers = await self._apply_clipped(repair_id, sync_groups, sync_answers, timeout_s)
                await self._repair_missed_rounds(repair_id, averaging, answers, timeout_s)
            return

        def failed_stages() -> list[int]:
            return [
                stage
                for stage, group in averaging.items()
                if round_failed({p: a for p, a in sync_answers.get(stage, {}).items() if p in group})
            ]

        for attempt in range(1, ROUND_RETRIES + 1):
            failed = failed_stages()
            if not failed:
                break
            self.counters.sync_round_retries += len(failed)
            for stage in failed:
                logger.warning(
                    f"stage {stage}: the replicas' averaging round failed and none stepped; "
                    f"committing again ({attempt}/{ROUND_RETRIES})"
                )
            again = [(stage, "sync", [p for p in averaging[stage] if p in sync_answers[stage]]) for stage in failed]
            sync_answers.update(
                await self._commit(f"{step_id}:again{attempt}", again, served, timeout_s, clip_phase=clip)
            )
            if clip is None:
                await self._repair_missed_rounds(f"{step_id}:again{attempt}", averaging, sync_answers, timeout_s)
        else:
            for stage in failed_stages():
                logger.warning(
                    f"stage {stage}: no averaging round after {ROUND_RETRIES} retries; the step's gradients "
                    f"carry over to the next commit"
                )
        if clip is not None:
            applied = await self._apply_clipped(f"{step_id}:apply", sync_groups, sync_answers, timeout_s)
            await self._repair_missed_rounds(f"{step_id}:apply", averaging, applied, timeout_s)

    async def outer_commit_done(self) -> None:
        """The last step's outer commit, if it went out in the background: awaited, its repair included."""
        task, self._outer_commit = self._outer_commit, None
        if task is not None:
            try:
                await task
            finally:
                self.client.follows_commit = None

    def cancel_outer_commit(self) -> None:
        """The run ends without a flush (an error): the outer commit in flight, if any, is dropped."""
        task, self._outer_commit = self._outer_commit, None
        self.client.follows_commit = None
        if task is not None:
            task.cancel()

    async def _commit_outer(self, step_id: str, groups, served, timeout_s: float) -> None:
        answers = await self._commit(step_id, groups, served, timeout_s)
        await self._repair_outer_groups(step_id, groups, answers, timeout_s)

    async def _repair_outer_groups(self, step_id: str, groups, answers, timeout_s: float) -> None:
        """After a commit of `groups` (stage, mode, replicas): the anchors of each outer-rounds group
        of two or more replicas repaired from `answers` (`_repair_outer_anchors`)."""
        outer = {stage: group for stage, mode, group in groups if mode == "outer" and len(group) > 1}
        if outer:
            await self._repair_outer_anchors(step_id, outer, answers, timeout_s)

    def _avoided(self, stage: int, peer_id: str) -> bool:
        """A replica routing avoids for long (it kept timing out, or broke the protocol), or one that
        never answered us and timed out: not committed (a sybil that stalls its calls stalls its
        commit too, and its averaging group's round, to their deadlines)."""
        return (
            self.view.bans.stalled(peer_id)
            or peer_id in self.view.violations.banned(stage)
            or self.caller.engine.timed_out_unanswered(peer_id)
        )

    def _failed_since(self, stage: int, record: PeerRecord) -> bool:
        """Whether `record`'s replica failed a commit and has not renewed its record since: a replica
        that died mid-run would otherwise be named in its group's rounds until its record expired,
        and every round that named it would fail."""
        expires_at = self._commit_failed.get((stage, record.peer_id))
        if expires_at is None:
            return False
        if record.expires_at > expires_at:  # renewed: alive, committed again
            del self._commit_failed[(stage, record.peer_id)]
            return False
        return True

    def _steps_alone(self, stage: int, mode: str, group: list[str]) -> bool:
        members = self.view.averaging_members(stage)
        return members is not None and len(group) == 1 and group[0] not in members

    def _commit_in_background(self, step_id: str, groups, served, timeout_s: float, *, flush: bool) -> None:
        task = asyncio.ensure_future(self._commit(step_id, groups, served, timeout_s, flush=flush))
        self._background.add(task)

        def done(finished: asyncio.Task) -> None:
            self._background.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                logger.warning(f"a lone replica's commit failed: {finished.exception()}")

        task.add_done_callback(done)

    async def _apply_clipped(
        self,
        step_id: str,
        sync_groups: list[tuple[int, str, list[str]]],
        prepared: dict[int, dict[str, CommitResponse]],
        timeout_s: float,
    ) -> dict[int, dict[str, CommitResponse]]:
        """Clipping's second phase: every sync replica steps on the gradient it prepared, scaled by
        min(1, --clip-grad-norm / the global norm over every stage's prepared gradient)."""
        norm = global_grad_norm(prepared)
        if anything_prepared(prepared):  # with a delay, the first step's commit holds no update yet
            self.grad_norms.append(norm)
        return await self._commit(
            step_id, sync_groups, {}, timeout_s, clip_phase="apply", clip_scale=clip_scale(norm, self.clip_grad_norm)
        )

    async def _commit(
        self,
        step_id: str,
        groups: list[tuple[int, str, list[str]]],
        served: dict[int, dict[str, int]],
        timeout_s: float,
        *,
        flush: bool = False,
        clip_phase: str | None = None,
        clip_scale: float | None = None,
    ) -> dict[int, dict[str, CommitResponse]]:
        """Commit `step_id` on every replica of `groups` ((stage, mode, peer ids)); the sync replicas'
        answers by stage and peer id. A replica whose commit fails is banned. `clip_phase`/`clip_scale`:
        clipping's phase, for the sync replicas (the others get a plain commit on "prepare")."""
        calls = [
            (
                stage,
                peer_id,
                mode,
                self.client.commit(
                    peer_id,
                    stage=stage,
                    step_id=step_id,
                    group_size=len(group),
                    timeout_s=timeout_s,
                    # a flush's own round (a failed last one, again) is weighed by what each replica holds
                    # (outer rounds: the round's members, each replica's samples beside it; periodic: the
                    # members of a round that follows the step, which then needs no matchmaking)
                    samples=(
                        {p: served.get(stage, {}).get(p, 0) for p in group}
                        if mode in ("sync", "outer", "periodic") and not flush
                        else None
                    ),
                    flush=flush,
                    clip_phase=clip_phase if mode == "sync" else None,
                    clip_scale=clip_scale if mode == "sync" else None,
                    gloo_rendezvous=gloo_leader(self.view.records[stage], group) if mode == "sync" else None,
                    sync_exchange=mode == "sync" and exchange_group(self.view.records[stage], group),
                ),
            )
            for stage, mode, group in groups
            for peer_id in group
        ]
        results = await asyncio.gather(*[call for *_, call in calls], return_exceptions=True)
        sync_answers: dict[int, dict[str, CommitResponse]] = {}
        for (stage, peer_id, mode, _), result in zip(calls, results):
            if isinstance(result, PeerCallError):
                logger.warning(f"stage {stage}: commit failed: {result}")
                stalled = result.kind == Failure.TIMEOUT and self.view.others_usable(stage, peer_id)
                self.view.bans.ban(peer_id, timed_out=stalled)
                record = next((r for r in self.view.records[stage] if r.peer_id == peer_id), None)
                if record is not None:
                    self._commit_failed[(stage, peer_id)] = record.expires_at
            elif isinstance(result, BaseException):
                raise result
            else:
                if mode in ("sync", "outer"):  # (a stage's groups are of one mode, see commit_groups)
                    sync_answers.setdefault(stage, {})[peer_id] = result
                if result.stepped:
                    self.counters.commits += 1
                    if result.averaged:
                        self.counters.averaged_commits += 1
        return sync_answers

    async def _repair_outer_anchors(
        self,
        step_id: str,
        outer: dict[int, list[str]],
        answers: dict[int, dict[str, CommitResponse]],
        timeout_s: float,
    ) -> None:
        """Outer-rounds replicas whose anchor is not their group's load the state of the replica with
        the most rounds applied (`outer_replicas_to_repair`), before the next step. A repair that
        fails bans the replica."""
        repairs = [
            (stage, repair)
            for stage, group in outer.items()
            for repair in outer_replicas_to_repair({p: a for p, a in answers.get(stage, {}).items() if p in group})
        ]
        for stage, repair in repairs:
            logger.warning(
                f"stage {stage}: replica {repair.peer_id[-8:]} holds another anchor than {repair.source[-8:]} "
                f"({answers[stage][repair.peer_id].outer_rounds} outer rounds against {repair.rounds}); "
                f"it loads {repair.source[-8:]}'s state"
            )
        caught_up = await self._catch_up(
            step_id,
            [(stage, repair.peer_id, {"catch_up_rounds": repair.rounds}, repair.source) for stage, repair in repairs],
            timeout_s,
        )
        for stage, peer_id, result in caught_up:
            answers[stage][peer_id] = result

    async def _repair_missed_rounds(
        self,
        step_id: str,
        averaging: dict[int, list[str]],
        answers: dict[int, dict[str, CommitResponse]],
        timeout_s: float,
    ) -> None:
        """Sync replicas of a stage's averaging group (`averaging`) that have taken fewer steps than
        another missed a round it completed (an all-reduce can fail on one side only, e.g. at its
        deadline), or joined with a state a step old: their parameters parted.
        Each such replica loads the state of one ahead (`replicas_to_repair`) before the next step;
        its answer is then taken at that step count. A repair that fails bans the replica."""
        repairs = []
        for stage, group in averaging.items():
            in_group = {p: a for p, a in answers.get(stage, {}).items() if p in group}
            seen = self._steps_seen.setdefault(stage, {})
            believed = plausible_steps(in_group, seen)
            for peer_id in sorted(set(in_group) - set(believed)):
                logger.warning(
                    f"stage {stage}: replica {peer_id[-8:]} answered {in_group[peer_id].steps_done} steps, "
                    f"{seen[peer_id]} at the last commit: no replica loads its state"
                )
            repairs += [(stage, repair) for repair in replicas_to_repair(believed)]
            seen.update({p: a.steps_done for p, a in believed.items()})
            self.caller.steps_committed.update({(stage, p): a.steps_done for p, a in believed.items()})
        if not repairs:
            return
        for stage, repair in repairs:
            logger.warning(
                f"stage {stage}: replica {repair.peer_id[-8:]} is behind {repair.source[-8:]} "
                f"({answers[stage][repair.peer_id].steps_done} steps against {repair.to_steps}); "
                f"it loads {repair.source[-8:]}'s state"
            )
        calls = [
            (stage, r.peer_id, {"catch_up_to": r.to_steps, "catch_up_drops_gradients": r.drops_gradients}, r.source)
            for stage, r in repairs
        ]
        for stage, peer_id, result in await self._catch_up(step_id, calls, timeout_s):
            previous = answers[stage][peer_id]
            answers[stage][peer_id] = previous.model_copy(update={"steps_done": result.steps_done})
            self._steps_seen.setdefault(stage, {})[peer_id] = result.steps_done
            self.caller.steps_committed[(stage, peer_id)] = result.steps_done

    async def _catch_up(
        self, step_id: str, calls: list[tuple[int, str, dict, str]], timeout_s: float
    ) -> list[tuple[int, str, CommitResponse]]:
        """Have each replica ((stage, peer id, the commit's catch-up fields, the source)) load its source's
        state; the answers of those that did. A replica whose catch-up fails is banned."""
        results = await asyncio.gather(
            *[
                self.client.commit(
                    peer_id,
                    stage=stage,
                    step_id=f"{step_id}:catch-up",
                    group_size=1,
                    timeout_s=timeout_s,
                    catch_up_from=source,
                    **fields,
                )
                for stage, peer_id, fields, source in calls
            ],
            return_exceptions=True,
        )
        caught_up = []
        for (stage, peer_id, _, _), result in zip(calls, results):
            if isinstance(result, PeerCallError):
                logger.warning(f"stage {stage}: replica {peer_id[-8:]} could not catch up: {result}")
                self.view.bans.ban(peer_id)
            elif isinstance(result, BaseException):
                raise result
            else:
                self.counters.replica_catch_ups += 1
                caught_up.append((stage, peer_id, result))
        return caught_up
