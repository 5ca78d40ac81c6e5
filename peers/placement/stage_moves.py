"""A peer changing the stage it serves: rebalancing moves and the standby (backup-pool) peer.

`StageMoves` is a service of the peer (peers/serving/host.py builds it): it swaps the stage of the
peer's `ServingState`, builds the next stage with the launcher's `StageBuilder`, announces through
the `Announcer` and copies the new stage's state with `ReplicaSyncService`. Decisions are the pure
functions of peers/placement/rebalance.py; this module only fetches, waits and swaps.

A move, in order: claim it on the DHT and go on only if the claim wins (`claim_verdict`);
announce `joining` at the new stage, then `offline` at the old one; build the new runtime while
the old one drains its requests (10 s at most), then download the new stage's state; swap the
runtimes on the compute thread (a late request for the old stage fails with `wrong_stage` and
fails over); announce `online`.

When to check: every `--rebalance-period-s` (randomised), and within `--rebalance-loss-delay-s` of
seeing a stage lose a replica. Each step's reasons: docs/design/placement.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import Executor

import hivemind
from hivemind.utils import get_dht_time

from dht.announce import fetch_stage_records_async
from dht.move_claims import fetch_move_claims_async, publish_move_claim_async
from dht.record_policy import MAX_MOVE_CLAIM_TTL_S
from dht.records import MoveClaim, PeerRecord, PeerState
from peers.compute.faults import FaultyStageRuntime
from peers.compute.stage_builder import BuiltStage, StageBuilder
from peers.compute.stage_runtime import StageRuntime
from peers.config import PlacementSettings
from peers.placement.rebalance import (
    MOVE_CLAIM_WAIT_S,
    RETURN_PERIODS,
    SETTLE_PERIODS,
    MoveDecision,
    ReplicaView,
    SettleWatch,
    choose_standby_target,
    claim_verdict,
    decide_move,
    loss_check_delay_s,
    move_claim_ttl_s,
    next_check_delay_s,
    settle_share,
    should_standby_take_over,
    stages_that_lost_replicas,
)
from peers.placement.stage_choice import claim_view, replica_views
from peers.placement.standby_copy import announced_steps, copy_refresh_due, fallback_warning
from peers.replicas.replica_sync import ReplicaSyncService
from peers.serving.announcer import Announcer
from peers.serving.checkpointer import Checkpointer
from peers.serving.serving_state import ServingState
from process.version import software_version

logger = logging.getLogger(__name__)

MIN_REQUESTS_BEFORE_MOVING = 20
"""Requests served before a peer considers moving: its throughput EMA (alpha 0.1) is then mostly
served work (0.9**20 = 12% start-up benchmark left)."""
CLAIM_TIMEOUT_S = 5.0
"""Longest wait for one DHT write or read of move claims."""


def _compute(runtime) -> StageRuntime:
    """The StageRuntime itself, under a fault-injection wrapper if there is one."""
    return runtime._runtime if isinstance(runtime, FaultyStageRuntime) else runtime


class StageMoves:
    def __init__(
        self,
        serving: ServingState,
        compute: Executor,
        dht: hivemind.DHT,
        settings: PlacementSettings,
        *,
        peer_id: str,
        model: str,
        builder: StageBuilder,
        announcer: Announcer,
        replicas: ReplicaSyncService,
        checkpointer: Checkpointer | None = None,
    ):
        self.serving, self.compute, self.dht, self.settings = serving, compute, dht, settings
        self.peer_id, self.model, self.builder = peer_id, model, builder
        self.announcer, self.replicas, self.checkpointer = announcer, replicas, checkpointer

    # --- the swarm as the decision functions see it ------------------------------------------------
    async def _all_records(self) -> list[PeerRecord]:
        stages = range(self.serving.runtime.num_stages)
        results = await asyncio.gather(*[fetch_stage_records_async(self.dht, self.model, s) for s in stages])
        records = [record for records in results for record in records]
        if self.replicas is not None:  # asked for state even if their records lapse a moment
            self.replicas.remember_members(records)
        return records

    async def swarm_views(self, *, include_self: bool = True) -> list[ReplicaView]:
        runtime = self.serving.runtime
        me = (
            ReplicaView(self.peer_id, runtime.stage, float(runtime.throughput.value), self.serving.state.value)
            if include_self
            else None
        )
        views = replica_views(await self._all_records(), runtime.num_stages, me=me)
        return views if include_self else [v for v in views if v.peer_id != self.peer_id]

    # --- rebalancing ------------------------------------------------------------------------------
    async def rebalance_forever(self, p2p, stop: asyncio.Event) -> None:
        settings = self.settings
        rng = random.Random(zlib.crc32(self.peer_id.encode()))  # peers started together check at different times
        next_check_at = time.monotonic() + next_check_delay_s(settings.rebalance_period_s, rng)
        watch_s = settings.rebalance_loss_watch_s
        settle = SettleWatch(
            SETTLE_PERIODS * settings.rebalance_period_s,
            share=settle_share(settings.rebalance_min_gain),
            return_s=RETURN_PERIODS * settings.rebalance_period_s,
        )
        while not stop.is_set():
            wake_at = next_check_at if watch_s <= 0 else min(next_check_at, time.monotonic() + watch_s)
            if await _stopped_within(stop, wake_at - time.monotonic()):
                return
            num_stages = self.serving.runtime.num_stages
            after_loss = False
            if time.monotonic() >= next_check_at:
                next_check_at = time.monotonic() + next_check_delay_s(settings.rebalance_period_s, rng)
            else:  # a look between periodic checks: check soon if a stage lost a replica since the last one
                # (a DHT lookup that timed out reads as an empty stage: at worst one needless check)
                try:
                    views = await self.swarm_views(include_self=False)
                    lost = () if settle.seen is None else stages_that_lost_replicas(settle.seen, views, num_stages)
                except ValueError as e:
                    logger.warning(f"Rebalancing look skipped: {e}")
                    continue
                settle.look(views, num_stages, time.monotonic())
                if not lost:
                    continue
                after_loss = True
                logger.info(f"stage(s) {list(lost)} lost a replica: checking whether to move")
                if await _stopped_within(stop, loss_check_delay_s(settings.rebalance_loss_delay_s, rng)):
                    return
            # Only with traffic: then our throughput is an EMA of served requests, not only the start-up
            # benchmark (measured to vary 4x on a loaded machine), and an idle swarm has nothing to gain.
            if self.serving.state != PeerState.ONLINE:
                print(f"rebalancing: no move, because this peer is {self.serving.state.value}", flush=True)
                continue
            if self.serving.requests_served < MIN_REQUESTS_BEFORE_MOVING:
                print(
                    f"rebalancing: no move, because this peer has served {self.serving.requests_served} requests "
                    f"(its throughput is measured from {MIN_REQUESTS_BEFORE_MOVING}; an idle swarm has nothing to gain)",
                    flush=True,
                )
                continue
            try:
                views = await self.swarm_views()
                settle.look([v for v in views if v.peer_id != self.peer_id], num_stages, time.monotonic())
                since = settle.settling_since(time.monotonic())
                if not after_loss and since is not None:
                    names = ", ".join("this peer" if p == self.peer_id else p[-8:] for p in settle.movers)
                    print(
                        f"rebalancing: no move, because the swarm is settling after a move ({names}; "
                        f"{since:.0f} s ago, waiting {settle.settle_s:.0f} s)",
                        flush=True,
                    )
                    continue
                decision = decide_move(self.peer_id, views, num_stages, min_gain=settings.rebalance_min_gain)
            except ValueError as e:  # a malformed snapshot: skip this check, never crash the peer
                logger.warning(f"Rebalancing check skipped: {e}")
                continue
            if not decision.move:
                print(f"rebalancing: no move, because {decision.reason}", flush=True)
                continue
            since = settle.return_barred_s(decision.from_stage, decision.to_stage, time.monotonic())
            if not after_loss and since is not None:
                print(
                    f"rebalancing: no move from stage {decision.from_stage} to stage {decision.to_stage}, because "
                    f"a move the other way was made {since:.0f} s ago (undoing one waits {settle.return_s:.0f} s: "
                    "the throughputs of a new layout are measured over seconds only)",
                    flush=True,
                )
                continue
            won = await self._claim_move(decision, stop)
            if won is None:
                continue
            print(
                f"rebalancing: moving from stage {decision.from_stage} to stage {decision.to_stage} "
                f"(bottleneck {decision.current_bottleneck:.1f} -> {decision.new_bottleneck:.1f} samples/s; "
                f"{decision.reason}; claim: {won})",
                flush=True,
            )
            seen = [v.peer_id for v in views if v.stage == decision.to_stage and v.state == PeerState.ONLINE.value]
            await self.move_to_stage(decision.to_stage, p2p, seen_replicas=seen)
            # our own move settles too, and bars its reverse
            settle.moved(self.peer_id, time.monotonic(), decision.from_stage, decision.to_stage)
            # The claim is left to lapse, not withdrawn: a peer whose snapshot was taken before this
            # move became visible may claim the same move while it is under way, and must lose.

    async def _claim_move(self, decision: MoveDecision, stop: asyncio.Event) -> str | None:
        """Claim the planned move on the DHT, wait, read the claims back and apply the claim rule
        (``claim_verdict``; see the module docstring). Returns why this peer may move; otherwise
        None, having printed why not and withdrawn the claim."""
        now = get_dht_time()
        ttl_s = min(move_claim_ttl_s(self.settings.rebalance_period_s), MAX_MOVE_CLAIM_TTL_S)
        claim = MoveClaim(
            peer_id=self.peer_id,
            model=self.model,
            num_stages=self.serving.runtime.num_stages,
            from_stage=decision.from_stage,
            to_stage=decision.to_stage,
            moves_from=decision.moves_from,
            moves_to=decision.moves_to,
            since=now,
            expires_at=now + ttl_s,
        )
        started = time.monotonic()
        stored = await publish_move_claim_async(self.dht, claim, timeout_s=CLAIM_TIMEOUT_S)
        store_s = time.monotonic() - started
        why_not = None
        if not stored:
            why_not = "this peer could not claim the move on the DHT"
        elif store_s > MOVE_CLAIM_WAIT_S / 2:
            # A claim stored later than half the wait might be missed by a peer that claimed after it
            # and read back before it landed: both could then take themselves for the winner.
            why_not = f"claiming the move on the DHT took {store_s:.1f} s (at most {MOVE_CLAIM_WAIT_S / 2:.1f} s)"
        else:
            if await _stopped_within(stop, MOVE_CLAIM_WAIT_S):
                await self._withdraw_claim(claim)
                return None
            claims = await fetch_move_claims_async(self.dht, self.model, timeout_s=CLAIM_TIMEOUT_S)
            if stop.is_set():  # stopped while reading: the peer's shutdown waits for this loop
                await self._withdraw_claim(claim)
                return None
            if claims is None:
                why_not = "the move claims could not be read back from the DHT"
            else:
                verdict = claim_verdict(claim_view(claim), [claim_view(c) for c in claims], get_dht_time())
                if verdict.wins:
                    return verdict.reason
                why_not = verdict.reason
        print(
            f"rebalancing: no move from stage {decision.from_stage} to stage {decision.to_stage}, because {why_not}",
            flush=True,
        )
        if stored:
            await self._withdraw_claim(claim)
        return None

    async def _withdraw_claim(self, claim: MoveClaim) -> None:
        """Mark the claim of a move this peer does not make withdrawn on the DHT (with a later expiry:
        a DHT node keeps the later-expiring value of a subkey). If that fails, it lapses by itself."""
        withdrawn = claim.model_copy(update={"active": False, "expires_at": claim.expires_at + 1.0})
        await publish_move_claim_async(self.dht, withdrawn, timeout_s=CLAIM_TIMEOUT_S)

    async def move_to_stage(self, stage: int, p2p, seen_replicas: Iterable[str] = ()) -> None:
        """Serve `stage` instead of the current one (see the module docstring for the steps).
        `seen_replicas`: the peers the move's plan saw online at `stage`, asked for its state even if
        their records lapsed meanwhile."""
        serving = self.serving
        old_stage, started = serving.runtime.stage, time.monotonic()
        serving.moving_to = stage
        serving.set_state(PeerState.JOINING)
        # joining at the new stage first: between the two stores a reader then sees us at both stages
        # (the newer record, joining, wins), never at neither, which reads as a lost replica and
        # made a second peer of the old stage move too
        await self.announcer.announce()
        await self.announcer.announce(stage=old_stage, state=PeerState.OFFLINE)
        if self.checkpointer is not None:
            await self.checkpointer.save_now()
        try:
            built = await asyncio.to_thread(self.builder.build, stage)
        except Exception as e:  # cannot build the new stage: stay where we are
            logger.error(f"Could not build stage {stage} ({type(e).__name__}: {e}); staying on stage {old_stage}")
            serving.moving_to = None
            serving.set_state(PeerState.ONLINE)
            await self.announcer.announce()
            return
        drained_s = await self._drain_old_stage()
        # The state last, right before the swap: the new stage's replicas keep stepping while we drain
        # (up to 10 s), and a copy taken before that would be served several of their steps out of date.
        if not await self.replicas.load_state_from_replica(p2p, built.runtime, seen_replicas):
            print(
                f"stage {stage}: no replica's state loaded; serving it from "
                f"{built.runtime.steps_done} steps done (a checkpoint's, or initial weights at 0)",
                flush=True,
            )
        # Announce what this peer served, not the new stage's start-up benchmark: the plan assumed the
        # peer's throughput moves with it, and a benchmark taken in a quiet second (measured up to 4x
        # the served EMA) made peers move back and forth. Real requests correct the EMA from here.
        _compute(built.runtime).throughput = _compute(serving.runtime).throughput.carried()
        await self._swap_stage(built)
        serving.moving_to = None
        serving.set_state(PeerState.ONLINE)
        await self.announcer.announce()
        print(
            f"moved from stage {old_stage} to stage {stage} in {time.monotonic() - started:.1f} s "
            f"(old stage drained for {drained_s:.1f} s) "
            f"(announcing {serving.runtime.throughput.value:.1f} samples/s, the EMA it served)",
            flush=True,
        )

    async def _drain_old_stage(self, quiet_s: float = 1.0, max_s: float = 10.0) -> float:
        """Keep serving the old stage until trainers have noticed our `offline` record there: no
        request in flight for `quiet_s`, or `max_s` at most. Fewer requests then fail over."""
        started = quiet_since = time.monotonic()
        while (now := time.monotonic()) - quiet_since < quiet_s and now - started < max_s:
            if self.serving.in_flight:
                quiet_since = now
            await asyncio.sleep(0.05)
        return time.monotonic() - started

    async def _swap_stage(self, built: BuiltStage) -> None:
        """Swap runtimes on the compute thread, so no compute ever sees half of each."""
        serving, old_averaging = self.serving, self.serving.averaging
        await asyncio.get_running_loop().run_in_executor(self.compute, serving.swap, built.runtime, built.averaging)
        serving.metrics.set_serving(
            stage=serving.runtime.stage, num_stages=serving.runtime.num_stages, version=software_version()
        )
        if old_averaging is not None:
            await asyncio.to_thread(old_averaging.shutdown)

    # --- standby (backup pool) ---------------------------------------------------------------------
    async def stand_by(self, p2p, stop: asyncio.Event) -> bool:
        """Hold a recent copy of the thinnest stage until a stage needs this peer. Returns True when
        taking over (the caller then goes online), False when stopped first.

        The copy is downloaded again whenever the stage's replicas announce steps it lacks, at most
        every `--standby-refresh-s` (peers/placement/standby_copy.py), and once more at takeover while
        a replica is online; taking over with no replica left falls back to the copy, with a warning
        saying how many steps old it is."""
        serving, settings = self.serving, self.settings
        serving.set_state(PeerState.STANDBY)
        tried_at, refreshed_at, announced_at = None, None, None
        stage_steps = 0  # the most steps the held stage's online replicas announced at the last look
        while not stop.is_set():
            num_stages = serving.runtime.num_stages
            try:
                records = await self._all_records()
                views = [v for v in replica_views(records, num_stages) if v.peer_id != self.peer_id]
                target = choose_standby_target(views, num_stages)
                take_over = should_standby_take_over(
                    views, num_stages, target, min_fraction=settings.standby_take_over_fraction
                )
            except ValueError as e:
                logger.warning(f"Standby check skipped: {e}")
                records, views, target, take_over = [], None, serving.runtime.stage, False
            if target != serving.runtime.stage:
                print(f"standby: now holding stage {target} (was {serving.runtime.stage})", flush=True)
                await self._swap_stage(await asyncio.to_thread(self.builder.build, target))
                tried_at, refreshed_at, stage_steps = None, None, 0
            announced = announced_steps(records, target, num_stages)  # None: no replica online now
            stage_steps = stage_steps if announced is None else announced
            seen = [v.peer_id for v in views or () if v.stage == target and v.state == PeerState.ONLINE.value]
            live = bool(seen)
            since_attempt_s = None if tried_at is None else time.monotonic() - tried_at
            due = copy_refresh_due(
                copy_steps=serving.runtime.steps_done,
                stage_steps=announced,
                since_attempt_s=since_attempt_s,
                min_interval_s=settings.standby_refresh_s,  # >= what a replica answers one caller (config)
            )
            loaded = False
            if live and (due or take_over):  # taking over with a live replica left: get its latest state first
                tried_at = time.monotonic()
                if loaded := await self.replicas.load_state_from_replica(p2p, seen_replicas=seen):
                    refreshed_at = tried_at
            if take_over:
                reason = "it fell behind" if live else "it has no online replica"
                if loaded:
                    print(
                        f"standby: taking over stage {target} ({reason}; with a live replica's state, "
                        f"{serving.runtime.steps_done} steps done)",
                        flush=True,
                    )
                else:
                    logger.warning(
                        fallback_warning(
                            stage=target,
                            reason=reason,
                            copy_steps=serving.runtime.steps_done,
                            stage_steps=stage_steps,
                            refreshed_s_ago=None if refreshed_at is None else time.monotonic() - refreshed_at,
                        )
                    )
                return True
            if announced_at is None or time.monotonic() - announced_at > self.announcer.settings.announce_period_s:
                await self.announcer.announce()
                announced_at = time.monotonic()
            try:
                await asyncio.wait_for(stop.wait(), timeout=settings.standby_check_s)
            except TimeoutError:
                pass
        return False


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(seconds, 0.0))
        return True
    except TimeoutError:
        return False
