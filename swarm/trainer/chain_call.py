"""Direct routing (`swarm train --routing direct`): one microbatch as one chained call, with re-drives.

`ChainCaller.run` picks a route (swarm/trainer/chain_route.py) and sends the microbatch's tokens
and targets to its stage-0 replica; the peers pass the activations on and the gradients back
(peers/serving/chain_rpc.py), and a failed hop is retried by the sending peer on the route's next
candidate. When the chain fails beyond those, its failed replicas are banned and the microbatch is
re-driven on a new route with the same id; a call whose stream broke is first re-driven along the
same route (`charge_route`). The attempts, the waits for the swarm and the counters are the call
engine's (swarm/trainer/call_engine.py): this module is the `ChainWork` it drives.

The answer names the replica that served each stage (`served_by`, for the sync round's weight
caps) and the replicas its hops failed over from (`failed_over`), each counted as a failed call and
routed around for a short ban only. `ChainCaller.audit` spot-checks a stage's call from what its
neighbours say crossed its hops (peers/serving/hop_records.py).

The exactly-once argument and its limits: docs/design/trainer.md.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from swarm.trainer.call_engine import Blame
from swarm.trainer.chain_route import (
    CHAIN_TASK,
    charge_route,
    check_served_by,
    choose_route,
    failovers_in_route,
    settle_route,
)
from swarm.trainer.client import ChainCallError, ChainResult, PeerCallError
from swarm.trainer.data import Microbatch
from swarm.trainer.failures import StageUnavailableError
from swarm.trainer.stage_call import StageAnswer, StageCaller, answer_bytes_limit
from wire.call_rules import Attempts, Penalty, penalty_for, refused_as_not_allowed
from wire.compression import CodecError, relative_error_bound
from wire.failures import Failure
from wire.protocol import ResponseHeader
from wire.tensors import encode_tensor

logger = logging.getLogger(__name__)

CHAIN_TIMEOUT_KEY = (-1, "chain")  # the TimeoutPolicy's (stage, task) slot for whole chains
ROUTE_ALTERNATES = 2  # replicas named after the preferred one, per stage


@dataclass(frozen=True)
class ChainAnswer:
    loss: float
    served_by: list[str]  # the replica that served each stage
    grad_samples: list[list[float]] = field(default_factory=list)  # each stage's gradient sample (spot checks)
    steps_done: list[int] = field(default_factory=list)  # the steps each stage's parameters had taken (spot checks)

    def steps_of(self, stage: int) -> int | None:
        """The steps `stage`'s replica says its parameters had taken, or None when the chain did not say."""
        return self.steps_done[stage] if len(self.steps_done) == len(self.served_by) else None


class ChainCaller:
    def __init__(self, caller: StageCaller, *, alternates: int = ROUTE_ALTERNATES):
        self.caller, self.view, self.client = caller, caller.view, caller.client
        self.alternates = alternates

    def _trainer_id(self) -> str:
        return self.client.p2p.peer_id.to_base58()

    async def run(self, microbatch_id: str, mb: Microbatch, failures: list[str]) -> ChainAnswer:
        """The microbatch as one chained call, re-driven until a chain answers (the call engine)."""
        return await self.caller.engine.drive(ChainWork(self, microbatch_id, mb, failures), failures)

    async def audit(
        self, stage: int, call: str, microbatch_id: str, mb: Microbatch, chain: ChainAnswer, *, send_tokens: bool
    ) -> None:
        """Spot-check the replica that served `stage` in a chain that answered: its forward (`call`
        "forward", a stage before the last) or its backward ("backward": on the last stage its fused
        call). What it computed on is what its neighbours say they sent it (peers/serving/hop_records.py:
        the activations from the replica before it, stage 0's from this trainer's tokens; the gradient
        from the replica after it, the last stage's from the targets), and its answer what they say
        they received from it (its outputs; its input gradient) and what the chain carried back (its
        loss, its gradient sample): the request and answer a hub spot check has, which
        `StageCaller.verify` asks a second replica to recompute, and a third on a mismatch. The
        chain's gradients are applied by then: a replica in the minority is banned for the run, so a
        lie costs the microbatches it served before it was caught (a hub check replaces the lying
        answer first). A record that cannot be fetched (evicted, the neighbour gone) leaves the call
        unchecked, counted."""
        caller, served_by, last = self.caller, chain.served_by, self.view.num_stages - 1
        outputs, response, codec = {}, ResponseHeader(steps_done=chain.steps_of(stage)), ("none", ())
        try:
            if stage == 0:
                inputs = encode_tensor(mb.inputs, "none")  # what the chain's first call carried
            else:
                inputs, _ = await self._hop_record(served_by[stage - 1], stage - 1, microbatch_id, "sent", mb.size)
            request = [("inputs", inputs)]
            if call == "forward":
                sent, decoded = await self._hop_record(
                    served_by[stage + 1], stage + 1, microbatch_id, "received", mb.size
                )
                outputs["outputs"] = (sent, decoded)
            else:
                if stage == last:
                    request.append(("targets", encode_tensor(mb.targets, "none")))
                else:
                    grad_outputs, _ = await self._hop_record(
                        served_by[stage + 1], stage + 1, microbatch_id, "grad_sent", mb.size
                    )
                    request.append(("grad_outputs", grad_outputs))
                if stage > 0:
                    outputs["grad_inputs"] = await self._hop_record(
                        served_by[stage - 1], stage - 1, microbatch_id, "grad_received", mb.size
                    )
                sample = chain.grad_samples[stage] if stage < len(chain.grad_samples) else None
                response = ResponseHeader(
                    loss=chain.loss if stage == last else None, grad_sample=sample, steps_done=chain.steps_of(stage)
                )
            if outputs:
                codec = (next(iter(outputs.values()))[0].header.codec, ())
                relative_error_bound(codec[0])  # a codec with no known error bound cannot be held to a tolerance
        except (PeerCallError, CodecError) as e:
            caller.counters.verify_records_missing += 1
            logger.warning(f"stage {stage}: {microbatch_id}'s {call} not spot-checked: no record of its hop ({e})")
            return
        if send_tokens and stage > 0:
            request.append(("tokens", encode_tensor(mb.inputs, "none")))
        answer = StageAnswer(
            {name: decoded for name, (_, decoded) in outputs.items()},
            response,
            served_by[stage],
            {name: sent for name, (sent, _) in outputs.items()},
            codec,
            tuple(request),
        )
        await caller.verify(stage, microbatch_id, mb.size, answer, call=call, step=mb.step)

    async def _hop_record(self, peer_id: str, stage: int, microbatch_id: str, side: str, batch_size: int):
        """`StageClient.hop_record`, asked once more when the stream broke or its answer came short (lost
        in transit: p2pd may reset a stream whose handler has returned before its last message is read)."""
        for attempt in range(2):
            try:
                return await self.client.hop_record(
                    peer_id,
                    stage=stage,
                    microbatch_id=microbatch_id,
                    side=side,
                    timeout_s=self.caller.timeouts.timeout_s(stage, "forward"),
                    max_answer_bytes=answer_bytes_limit(batch_size * self.caller.seq_len * self.caller.d_model),
                )
            except PeerCallError as e:
                if e.kind not in (Failure.TRANSPORT, Failure.GARBAGE) or attempt == 1:
                    raise

    def blame(self, error: PeerCallError, route: list[list[str]], took_s: float) -> list[Blame]:
        """The replicas a failed chain is blamed on: each hop it failed over from on the way, as the
        peers before them said (`failovers`, within the route), and the replicas of the stage that
        failed it (`failed_peers`), each once. A refusal that shuts us out is the first replica's
        own answer: that one is shut out."""
        stage = getattr(error, "stage", 0)
        hops = failovers_in_route(route, getattr(error, "failovers", []))
        blames = [
            Blame(
                f.peer,
                f.stage,
                f.kind,
                penalty_for(f.kind, "", witnessed=False),
                f"a hop failed over ({f.kind.value})",
                witnessed=False,
            )
            for f in hops
        ]
        if error.kind == Failure.REFUSED and refused_as_not_allowed(str(error)):
            return [b for b in blames if b.stage != stage] + [
                Blame(error.peer_id, stage, error.kind, Penalty.SHUT_OUT, str(error))
            ]
        covered = {(f.peer, f.stage) for f in hops}
        for peer_id in getattr(error, "failed_peers", [error.peer_id]):
            if (peer_id, stage) not in covered:
                penalty = penalty_for(error.kind, str(error), witnessed=False)
                own = peer_id == route[0][0]  # the trainer's own call (its timeout, its own observation)
                at_least_s = 3.0 * took_s if own else 0.0
                blames.append(
                    Blame(peer_id, stage, error.kind, penalty, str(error), at_least_s=at_least_s, witnessed=own)
                )
        return blames


class ChainWork:
    """One microbatch's chained call, as the call engine drives it (swarm/trainer/call_engine.py)."""

    stage, rpc, timeout_key = 0, "train_chain", CHAIN_TIMEOUT_KEY
    waiting_for = "a chain through every stage"
    adds_work = True  # every replica of the route adds the microbatch's gradients
    waits_on_others = True  # a timeout may be a hang further down: not asked again

    def __init__(self, chains: ChainCaller, microbatch_id: str, mb: Microbatch, failures: list[str]):
        self.chains, self.view, self.caller = chains, chains.view, chains.caller
        self.microbatch_id, self.mb, self.failures = microbatch_id, mb, failures
        self.tensors = [("inputs", encode_tensor(mb.inputs, "none")), ("targets", encode_tensor(mb.targets, "none"))]
        self.last_route: list[list[str]] | None = None

    def choose(self, exclude) -> list[list[str]] | None:
        view = self.view
        return choose_route(
            view.schedulers,
            self.mb.size,
            [exclude(stage) for stage in range(view.num_stages)],
            alternates=self.chains.alternates,
        )

    def again(self, peer_id: str) -> list[list[str]] | None:
        """The route whose first call's stream broke, driven once more as it was: its replicas may hold
        this microbatch's gradients already, and only they answer the repeat without adding it."""
        if self.last_route is None or self.last_route[0][0] != peer_id:
            return None
        return charge_route(self.view.schedulers, self.last_route, self.mb.size)

    def key(self, route: list[list[str]]) -> str:
        return route[0][0]

    def expected_s(self, route: list[list[str]]) -> float | None:
        """The chain's expected time: each stage's preferred replica's (None if one is not known)."""
        schedulers = self.view.schedulers
        expected = [schedulers[s].expected_s(c[0], CHAIN_TASK, self.mb.size) for s, c in enumerate(route)]
        return None if any(e is None for e in expected) else sum(expected)

    def replicas(self, route: list[list[str]]) -> list[tuple[int, str]]:
        """Each stage's preferred replica: those the chain goes through unless a hop fails over."""
        return [(stage, candidates[0]) for stage, candidates in enumerate(route)]

    async def call(self, route: list[list[str]], timeout_s: float) -> ChainResult:
        caller = self.caller
        self.last_route = route
        called = time.perf_counter()
        result = await self.chains.client.train_chain(
            route[0][0],
            microbatch_id=self.microbatch_id,
            batch_size=self.mb.size,
            tensors=self.tensors,
            route=route[1:],
            timeout_s=timeout_s,
            trainer_id=self.chains._trainer_id(),
            codec=caller.codecs.mode,
            topk_fraction=caller.codecs.topk_fraction,
            loss_budget=None if math.isinf(caller.codecs.loss_budget) else caller.codecs.loss_budget,
            keep_records=caller.spot_checks.fraction > 0.0,
        )
        caller.phases.add("call", time.perf_counter() - called)
        wrong = check_served_by(route, result.served_by)
        if wrong is None and caller.spot_checks.fraction > 0.0:
            wrong = result.samples_problem
        if wrong is not None:
            raise ChainCallError(route[0][0], Failure.GARBAGE, wrong, stage=0, failed_peers=[route[0][0]])
        return result

    def failed(self, route: list[list[str]], error: PeerCallError, started: float, done: float) -> list[Blame]:
        settle_route(self.view.schedulers, route, self.mb.size, [])
        return self.chains.blame(error, route, done - started)

    def answered(self, route: list[list[str]], result: ChainResult, started: float, done: float) -> ChainAnswer:
        engine = self.caller.engine
        settle_route(self.view.schedulers, route, self.mb.size, result.served_by, done - started)
        failed_over = failovers_in_route(route, result.failed_over)
        if failed_over:  # a hop failed over inside the chain: the microbatch was retried there
            self.failures.append(f"the chain failed over from {sorted(f.peer[-8:] for f in failed_over)}")
            engine.counters.calls_retried += len(failed_over)
            engine.note_failure(
                self.rpc,
                [
                    Blame(
                        f.peer,
                        f.stage,
                        f.kind,
                        penalty_for(f.kind, "", witnessed=False),
                        "a hop failed over",
                        witnessed=False,
                    )
                    for f in failed_over
                ],
            )
        for stage, peer_id in enumerate(result.served_by):
            engine.note_answered(peer_id, stage, "backward", self.mb.size)
        for stage, (peer_id, busy) in enumerate(zip(result.served_by, result.busy)):
            engine.contributions.busy(peer_id, stage, (busy.busy_s, busy.clock_s))
        return ChainAnswer(result.loss, result.served_by, result.grad_samples, result.steps_done)

    def unavailable(self, waited_s: float, attempts: Attempts) -> StageUnavailableError:
        empty = [s for s, n in enumerate(self.view.live_replicas()) if not n] or [0]
        return StageUnavailableError(
            empty[0],
            f"no chain through every stage for {waited_s:.0f} s; start a peer for each stage with no live "
            f"replica or raise --stage-wait-timeout-s",
        )
