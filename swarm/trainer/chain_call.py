"""Direct routing (`swarm train --routing direct`): one microbatch as one chained call, with re-drives.

`ChainCaller.run` picks a route (swarm/trainer/chain_route.py: for every stage a preferred replica
and alternates) and sends the microbatch's tokens and targets to the route's stage-0 replica; each
peer sends its outputs straight to the next stage's replica and the gradient comes back the same way
(peers/serving/chain_rpc.py), so each boundary's link carries the activation once forward and its
gradient once back. A hop that fails is retried by the sending peer on the route's next candidate
for that stage. When the chain fails beyond those (or the stage-0 replica does), the replicas that
failed are banned and the microbatch is re-driven from the start on a new route, with the same
microbatch id: a replica that already ran that microbatch's backward in a failed attempt answers a
repeat without accumulating it twice (the argument, and its limits, are in chain_rpc.py's docstring).
A call whose stream broke is re-driven once along the same route first (`charge_route`): its
replicas may have added the microbatch before the answer was lost, and only they can answer it
without adding it again.
After `max_retries` failed attempts it waits for the swarm as hub routing does, refreshing the view,
and stops the run after `stage_wait_timeout_s` rather than lose the microbatch.

The answer names the replica that served each stage (`served_by`): the schedule counts each one's
samples from it, for the sync round's weight caps, exactly as from hub routing's backward answers.
It also names the replicas its hops failed over from and how (`failed_over`, also on a chain that
failed): each one the route named is counted as a failed call of that kind (`failures_by_kind`,
the metrics, the replica's ledger entry) and routed around for a short ban only, a peer's word about
another being no proof.
`ChainCaller.audit` spot-checks a stage of a chain that answered, from what the stage's neighbours
say crossed its hops (peers/serving/hop_records.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from swarm.trainer.chain_route import charge_route, check_served_by, choose_route, failovers_in_route, settle_route
from swarm.trainer.client import ChainCallError, PeerCallError
from swarm.trainer.data import Microbatch
from swarm.trainer.failures import NotAllowedError, StageUnavailableError, refused_as_not_allowed
from swarm.trainer.stage_call import StageAnswer, StageCaller, answer_bytes_limit
from wire.compression import CodecError, relative_error_bound
from wire.failures import Failure
from wire.protocol import HopFailover, ResponseHeader
from wire.tensors import encode_tensor

logger = logging.getLogger(__name__)

CHAIN_TIMEOUT_KEY = (-1, "chain")  # the TimeoutPolicy's (stage, task) slot for whole chains
ROUTE_ALTERNATES = 2  # replicas named after the preferred one, per stage


@dataclass(frozen=True)
class ChainAnswer:
    loss: float
    served_by: list[str]  # the replica that served each stage


class ChainCaller:
    def __init__(self, caller: StageCaller, *, alternates: int = ROUTE_ALTERNATES):
        self.caller, self.view, self.client = caller, caller.view, caller.client
        self.alternates = alternates

    def _trainer_id(self) -> str:
        return self.client.p2p.peer_id.to_base58()

    async def run(self, microbatch_id: str, mb: Microbatch, failures: list[str]) -> ChainAnswer:
        caller, view = self.caller, self.view
        tensors = [("inputs", encode_tensor(mb.inputs, "none")), ("targets", encode_tensor(mb.targets, "none"))]
        failed: set[str] = set()  # replicas that failed this microbatch: not named again (until we wait)
        attempts, waited_since = 0, None
        # A route whose first call's stream broke is driven once more as it was: its replicas may hold
        # this microbatch's gradients already, and only they answer the repeat without adding it.
        again, asked_again = None, set()
        while True:
            route = None if again is None else charge_route(view.schedulers, again, mb.size)
            again = None
            if route is None:
                exclude = view.bans.banned() | failed | caller.not_allowed_by.keys()
                route = choose_route(
                    view.schedulers,
                    mb.size,
                    [exclude | view.violations.banned(stage) for stage in range(view.num_stages)],
                    alternates=self.alternates,
                )
            if route is None or attempts > caller.max_retries:
                if route is None and caller.not_allowed_by:
                    raise NotAllowedError(0, self._trainer_id(), list(caller.not_allowed_by.values()))
                waited_since = waited_since or time.monotonic()
                await self._wait(waited_since)
                failed.clear()
                attempts = 0
                continue
            waited_since = None
            timeout_s = caller.timeouts.timeout_s(*CHAIN_TIMEOUT_KEY)
            started = time.perf_counter()
            try:
                result = await self.client.train_chain(
                    route[0][0],
                    microbatch_id=microbatch_id,
                    batch_size=mb.size,
                    tensors=tensors,
                    route=route[1:],
                    timeout_s=timeout_s,
                    trainer_id=self._trainer_id(),
                    codec=caller.codecs.mode,
                    topk_fraction=caller.codecs.topk_fraction,
                    loss_budget=None if math.isinf(caller.codecs.loss_budget) else caller.codecs.loss_budget,
                    keep_records=caller.spot_checks.fraction > 0.0,
                )
                wrong = check_served_by(route, result.served_by)
                if wrong is not None:
                    raise ChainCallError(route[0][0], Failure.GARBAGE, wrong, stage=0, failed_peers=[route[0][0]])
            except PeerCallError as e:
                settle_route(view.schedulers, route, mb.size, [])
                attempts += 1
                self._note_failure(e, route, failures, time.perf_counter() - started)
                if e.kind == Failure.TRANSPORT and getattr(e, "stage", 0) == 0 and route[0][0] not in asked_again:
                    asked_again.add(route[0][0])
                    again = route
                    caller.counters.backward_asked_again += 1
                    continue
                failed |= set(getattr(e, "failed_peers", [e.peer_id]))
                continue
            elapsed = time.perf_counter() - started
            settle_route(view.schedulers, route, mb.size, result.served_by)
            caller.timeouts.observe(*CHAIN_TIMEOUT_KEY, elapsed)
            caller.metrics.observe_call(stage=0, rpc="train_chain", duration_s=elapsed)
            failed_over = failovers_in_route(route, result.failed_over)
            if failed_over:  # a hop failed over inside the chain: the microbatch was retried there
                failures.append(f"the chain failed over from {sorted(f.peer[-8:] for f in failed_over)}")
                caller.counters.calls_retried += len(failed_over)
                for failover in failed_over:
                    self._count_failure(failover.kind, failover.stage)
                    self._route_around(failover)
            for stage, peer_id in enumerate(result.served_by):
                view.bans.clear(peer_id)
                key = peer_id[-8:]
                caller.counters.calls_by_peer[key] = caller.counters.calls_by_peer.get(key, 0) + 1
                caller.contributions.answered(peer_id, stage, "backward", mb.size)
            return ChainAnswer(result.loss, result.served_by)

    async def audit(
        self, stage: int, microbatch_id: str, mb: Microbatch, served_by: list[str], *, send_tokens: bool
    ) -> None:
        """Spot-check the replica that served `stage` (not the last) in a chain that answered. Its
        inputs as the replica before it sent them (stage 0: this trainer's tokens) and its outputs as
        the replica after it received them (peers/serving/hop_records.py: its neighbours tell, not the
        replica) make the forward call a hub spot check makes, and `StageCaller.verify` asks a second
        replica of the stage for it, and a third on a mismatch. The chain's gradients are applied by
        then: a replica in the minority is banned for the run, so a lie costs the microbatches it
        served before it was caught (a hub check replaces the lying answer first). A record that
        cannot be fetched (evicted, the neighbour gone) leaves the chain unchecked, counted."""
        caller = self.caller
        try:
            if stage == 0:
                inputs = encode_tensor(mb.inputs, "none")  # what the chain's first call carried
            else:
                inputs, _ = await self._hop_record(served_by[stage - 1], stage - 1, microbatch_id, "sent", mb.size)
            outputs, decoded = await self._hop_record(
                served_by[stage + 1], stage + 1, microbatch_id, "received", mb.size
            )
            codec = outputs.header.codec
            relative_error_bound(codec)  # a codec with no known error bound cannot be held to a tolerance
        except (PeerCallError, CodecError) as e:
            caller.counters.verify_records_missing += 1
            logger.warning(f"stage {stage}: {microbatch_id} not spot-checked: no record of its hop ({e})")
            return
        request = [("inputs", inputs)]
        if send_tokens and stage > 0:
            request.append(("tokens", encode_tensor(mb.inputs, "none")))
        answer = StageAnswer(
            {"outputs": decoded}, ResponseHeader(), served_by[stage], {"outputs": outputs}, (codec, ()), tuple(request)
        )
        await caller.verify(stage, microbatch_id, mb.size, answer)

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

    def _note_failure(self, error: PeerCallError, route: list[list[str]], failures: list[str], took_s: float) -> None:
        caller = self.caller
        failures.append(str(error))
        caller.counters.calls_retried += 1
        stage = getattr(error, "stage", 0)
        hops = failovers_in_route(route, getattr(error, "failovers", []))  # how each failed hop failed
        for kind, at in [(f.kind, f.stage) for f in hops] or [(error.kind, stage)]:
            self._count_failure(kind, at)
        for failover in hops:  # an earlier stage's hop failed over before the chain failed at `stage`
            if failover.stage != stage:  # (`stage`'s replicas are the error's `failed_peers`, below)
                self._route_around(failover)
        if error.kind == Failure.REFUSED and refused_as_not_allowed(str(error)):
            caller.not_allowed_by[error.peer_id] = error.peer_id[-8:]
            return
        for peer_id in getattr(error, "failed_peers", [error.peer_id]):
            caller.contributions.failed(peer_id, stage)
            if error.kind == Failure.WRONG_STAGE:
                caller.view.violations.wrong_stage(peer_id, stage, str(error))
            else:
                caller.view.bans.ban(peer_id, at_least_s=3.0 * took_s if peer_id == route[0][0] else 0.0)
        logger.info(f"{error}; driving the microbatch again on another route")

    def _route_around(self, failover: HopFailover) -> None:
        """A replica a hop failed over from: a failed call in its ledger entry, and a short ban, as
        after any failed call (a peer's word about another is no proof of more)."""
        self.caller.contributions.failed(failover.peer, failover.stage)
        self.view.bans.ban(failover.peer)

    def _count_failure(self, kind: Failure, stage: int) -> None:
        """One failed call, the trainer's own or a hop's inside a chain, in the report and metrics."""
        counters = self.caller.counters
        counters.failures_by_kind[kind.value] = counters.failures_by_kind.get(kind.value, 0) + 1
        self.caller.metrics.observe_failure(stage=stage, rpc="train_chain", kind=kind.value)

    async def _wait(self, since: float) -> None:
        """No route can be formed (or this microbatch failed too often): refresh the view until one
        can, or stop the run after `stage_wait_timeout_s`."""
        caller = self.caller
        waited = time.monotonic() - since
        if waited > caller.stage_wait_timeout_s:
            empty = [s for s, n in enumerate(self.view.live_replicas()) if not n] or [0]
            raise StageUnavailableError(
                empty[0],
                f"no chain through every stage for {waited:.0f} s; start a peer for each stage with no live "
                f"replica or raise --stage-wait-timeout-s",
            )
        next_unban = self.view.bans.seconds_until_next_unban()
        await asyncio.sleep(min(1.0, next_unban if next_unban is not None else 1.0))
        await self.view.refresh()
