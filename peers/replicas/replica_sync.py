"""Replica agreement on the peer: the commit RPC (sync averaging), the state RPC (a joiner's download),
loading state from a replica before going online, and periodic parameter averaging (by time: a loop;
by steps: on the commit).

`ReplicaSyncService` works on the stage of a `ServingState` (peers/serving/serving_state.py): its
runtime and averager, which a move swaps together. The admission guard (peers/serving/admission.py)
admits a caller before the RPC handlers here run; it answers a refused one with `refused_commit` or
`refused_state`, the answers these RPCs give any bad request. In a run with an authority, both
handlers ask it (`authorize`, the guard's) whether the caller's credential allows a commit (a
trainer's) or a state download (a trainer's, or a peer's of this stage) before doing anything.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from functools import partial

import hivemind
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from dht.announce import fetch_stage_records_async
from dht.authority import RunAuthority, credentialed_records
from dht.records import PeerRecord, PeerState
from peers.compute.checkpoint import CheckpointError
from peers.compute.stage_runtime import REPLICA_STATE_KEY
from peers.replicas.averaging import GradientSync, ParameterAveraging
from peers.replicas.averaging_members import AveragingMembers
from peers.replicas.delayed_sync import DelayedGradientSync
from peers.replicas.donor_choice import (
    STEP_SLACK,
    StateOffer,
    choose_donors,
    refusals,
    shuffled,
    step_bound,
    steps_by_now,
)
from peers.replicas.outer_averaging import OuterAveraging
from peers.replicas.outer_exchange import OuterExchange
from peers.replicas.state_transfer import StateExports, download_state, fetch_offer, state_bytes_bound
from peers.serving.admission import caller_id
from peers.serving.serving_state import ServingState
from wire.messages import read_unary, unary_response, write_state
from wire.protocol import CommitRequest, CommitResponse, ProtocolError, StateHeader, StateRequest

logger = logging.getLogger(__name__)
MAX_DONORS = 4  # replicas a joiner asks what they would send, at most
MEMBER_MEMORY_S = 600.0  # how long a peer seen with a credential of its stage counts as a member


class ReplicaSyncService:
    def __init__(
        self,
        serving: ServingState,
        compute: Executor,
        dht: hivemind.DHT,
        *,
        peer_id: str,
        model: str,
        averaging_timeout_s: float,
        authorize: Callable[..., None] | None = None,
        credential: str | None = None,
        members: AveragingMembers | None = None,
        authority: RunAuthority | None = None,
        rng: random.Random | None = None,
        follower=None,
    ):
        """`authorize(caller, credential, action, stage=...)`: raises unless the caller may (the
        admission guard's); `credential`: this peer's own, presented when it downloads state;
        `authority`: the run's, whose credentialed replicas alone are asked for state; `rng`: the
        order donors are asked in (default: the system's randomness, which no peer can steer);
        `follower`: the run's spec (peers/serving/run_follower.py), whose version a commit names."""
        self.serving, self.compute, self.dht = serving, compute, dht
        self.peer_id, self.model, self.averaging_timeout_s = peer_id, model, averaging_timeout_s
        self.state_exports = StateExports()  # rate-limited per caller, serialized once per step
        self.authorize = authorize or (lambda *args, **kwargs: None)
        self.credential = credential
        self.members = members  # a run with an authority: who may average with us, kept fresh
        self.authority = authority
        self.rng = rng or random.SystemRandom()
        self._members_seen: dict[str, tuple[int, float]] = {}  # peer -> (stage, when) seen credentialed
        self._sync_replicas: tuple[tuple[int, int], float, tuple[PeerRecord, ...]] | None = None  # (stage, at, records)
        self.outer = OuterExchange(  # `--averaging outer`: the rounds' RPC and commit
            averaging=lambda: serving.averaging,
            p2p=lambda: dht.replicate_p2p(),
            peer_id=peer_id,
            model=model,
            compute=compute,
            authorize=self.authorize,
            credential=credential,
        )
        self.follower = follower

    @staticmethod
    def refused_commit(error: Exception, waited_s: float) -> runtime_pb2.ExpertResponse:
        return unary_response(CommitResponse(error=str(error)))

    @staticmethod
    def refused_state(error: Exception, waited_s: float):
        return write_state(StateHeader(error=str(error)), b"")

    async def rpc_commit(self, request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        """Sync averaging: the trainer finished a step; average gradients with the other replicas and step."""
        serving = self.serving
        handled = None  # the commit's step id, once its trainer is authorized: calls that follow it go on after
        try:
            commit = read_unary(request, CommitRequest)
            self.authorize(caller_id(context), commit.credential, "train")
            handled = commit.step_id
            if (commit.model, commit.stage, commit.num_stages) != (
                self.model,
                serving.runtime.stage,
                serving.runtime.num_stages,
            ):
                raise ProtocolError(
                    f"this peer serves {self.model} stage {serving.runtime.stage}/{serving.runtime.num_stages}"
                )
            averaging = serving.averaging
            if commit.catch_up_from is not None:
                await self.catch_up(
                    commit.catch_up_from,
                    to_steps=commit.catch_up_to,
                    drop_gradients=commit.catch_up_drops_gradients,
                    to_rounds=commit.catch_up_rounds,
                )
                return unary_response(self._caught_up(serving.averaging))
            if self.members is not None:  # a replica that joined since the last refresh is let in now
                await self.members.refresh_if_short(commit.group_size)
            elif commit.samples and getattr(averaging, "named_groups", False) and not by_time(averaging):
                await self.check_named_group(commit)  # without a member list: only live replicas
            if self.follower is not None and commit.spec_version:
                # the step follows the spec version the trainer names, so its replicas step on one schedule
                if not await self.follower.ensure(commit.spec_version):
                    raise ProtocolError(
                        f"this peer has not found version {commit.spec_version} of run {self.follower.run_id}'s "
                        f"spec (it knows version {self.follower.version})"
                    )
                serving.runtime.follow_schedule(self.follower.schedule(commit.spec_version))
            commit = commit.model_copy(update={"group_size": await self.bounded_group_size(commit.group_size)})
            if isinstance(averaging, OuterAveraging):
                return unary_response(await self.outer_commit(averaging, commit))
            loop = asyncio.get_running_loop()
            delayed = isinstance(averaging, DelayedGradientSync)
            if commit.flush and not delayed:  # only a delayed update has anything to flush
                outcome = None
            elif commit.clip_phase is not None and isinstance(averaging, GradientSync):
                # clipping by the global norm, in two phases (with a delay: of the update applied)
                if commit.clip_phase == "prepare":
                    if delayed:  # the round in flight ends in the averager's process: wait off the compute thread
                        await loop.run_in_executor(None, averaging.wait_in_flight)
                    flush = {"flush": commit.flush} if delayed else {}
                    call = partial(
                        with_named_round,
                        averaging,
                        commit,
                        partial(averaging.prepare, commit.step_id, commit.group_size, commit.samples, **flush),
                    )
                else:
                    call = partial(averaging.apply_prepared, commit.step_id, commit.clip_scale or 1.0)
                outcome = await loop.run_in_executor(self.compute, call)
            elif commit.clip_phase == "apply":  # a replica that does not clip stepped on "prepare" (a plain commit)
                outcome = None
            elif delayed:
                await loop.run_in_executor(None, averaging.wait_in_flight)
                outcome = await loop.run_in_executor(
                    self.compute,
                    partial(averaging.commit, flush=commit.flush),
                    commit.step_id,
                    commit.group_size,
                    commit.samples,
                )
            elif isinstance(averaging, GradientSync):
                call = partial(averaging.commit, commit.step_id, commit.group_size, commit.samples)
                outcome = await loop.run_in_executor(self.compute, with_named_round, averaging, commit, call)
            elif isinstance(averaging, ParameterAveraging) and averaging.rounds_schedule.by_steps:
                # the round, if one follows this step, is sized for the replicas we see online (as by time)
                group_size = await self.periodic_group_size() if averaging.round_due_after_next_step() else 1
                named = list(commit.samples) if commit.samples else None  # the group the trainer committed to
                outcome = await loop.run_in_executor(self.compute, averaging.commit, commit.step_id, group_size, named)
                if outcome.averaged:
                    self._print_round(outcome)
            else:  # no averaging, or periodic by time: replicas step on their own, nothing to do
                outcome = None
            response = (
                CommitResponse(steps_done=serving.runtime.steps_done)
                if outcome is None
                else CommitResponse(
                    stepped=outcome.stepped,
                    averaged=outcome.averaged,
                    group_size=outcome.group_size,
                    samples=outcome.samples,
                    steps_done=serving.runtime.steps_done,
                    pending=outcome.pending,
                    grad_norm_sq=outcome.grad_norm_sq,
                )
            )
        except ProtocolError as e:
            response = CommitResponse(error=str(e))
        finally:
            if handled is not None:
                serving.commits.done(handled)
        return unary_response(response)

    async def outer_commit(self, averaging: OuterAveraging, commit: CommitRequest) -> CommitResponse:
        """`--averaging outer`: the local step, then the rounds due (peers/replicas/outer_exchange.py);
        a flush awaits and applies the rounds still in flight. The members: those the commit names."""
        if commit.flush:
            outcome = await self.outer.flush(averaging)
        else:
            outcome = await self.outer.commit(averaging, commit.step_id, commit.samples or [self.peer_id])
            if outcome.applied:
                print(
                    f"outer round with {outcome.group_size - 1} other replica(s) (rounds applied "
                    f"{averaging.outer_rounds}; {outcome.steps_done} steps done)",
                    flush=True,
                )
        return CommitResponse(
            stepped=outcome.stepped,
            averaged=outcome.applied > 0,
            group_size=outcome.group_size,
            samples=outcome.samples,
            steps_done=outcome.steps_done,
            pending=outcome.pending,
            outer_rounds=averaging.outer_rounds,
            anchor=averaging.anchor_digest(),
        )

    def _caught_up(self, averaging) -> CommitResponse:
        steps_done = self.serving.runtime.steps_done
        if isinstance(averaging, OuterAveraging):
            return CommitResponse(
                steps_done=steps_done, outer_rounds=averaging.outer_rounds, anchor=averaging.anchor_digest()
            )
        return CommitResponse(steps_done=steps_done)

    async def rpc_state(self, request: runtime_pb2.ExpertRequest, context):
        """Stream this stage's parameters and optimizer state to a joining replica."""
        serving = self.serving
        try:
            wanted = read_unary(request, StateRequest)
            self.authorize(caller_id(context), wanted.credential, "state", stage=serving.runtime.stage)
            if (wanted.model, wanted.stage, wanted.num_stages) != (
                self.model,
                serving.runtime.stage,
                serving.runtime.num_stages,
            ):
                raise ProtocolError(
                    f"this peer serves {self.model} stage {serving.runtime.stage}/{serving.runtime.num_stages}"
                )
            refusal = self.state_exports.refusal(caller_id(context), offer=wanted.digest_only)
            if refusal is not None:
                raise ProtocolError(refusal)
            data, steps_done, digest = await self.state_exports.export(serving.runtime, self.model, self.compute)
            if wanted.digest_only:  # what we would send, before the caller chooses among donors
                data = b""
            header = StateHeader(total_bytes=len(data), steps_done=steps_done, digest=digest)
        except ProtocolError as e:
            header, data = StateHeader(error=str(e)), b""
        for message in write_state(header, data):
            yield message

    async def catch_up(
        self, source: str, *, to_steps: int | None = None, drop_gradients: bool = True, to_rounds: int | None = None
    ) -> None:
        """Sync averaging's repair (the trainer asks for it): this replica missed a round that `source`,
        a replica of the same stage, completed, so the replicas' parameters parted. Load its state
        (parameters, optimizer state and step count) on the compute thread, before the next step's
        forwards; with `drop_gradients`, first drop the accumulated gradients, which `source`'s update
        holds already. Nothing is done when this replica has done `to_steps` steps (what the trainer
        saw `source` at) already, and nothing is loaded that is not ahead of this replica: with several
        trainers, two may ask for the same repair, or a round may have moved both replicas on since."""
        runtime, averaging = self.serving.runtime, self.serving.averaging
        outer = isinstance(averaging, OuterAveraging)  # its replicas take the same steps: compared by rounds
        if outer and to_rounds is not None and averaging.outer_rounds > to_rounds:
            return
        if not outer and to_steps is not None and runtime.steps_done >= to_steps:
            return
        request = StateRequest(
            model=self.model, stage=runtime.stage, num_stages=runtime.num_stages, credential=self.credential
        )
        # the source as a joiner would take it: a member of the run, holding no more steps than the
        # other live peers of the run announce (a trainer's word names it, the DHT must bear it out)
        records = {r.peer_id: r for r in await self.live_records(runtime)}
        if source not in records:
            raise ProtocolError(
                f"replica {source[-8:]} is no live member of stage {runtime.stage}: not loading its state"
            )
        bound = step_bound(source, runtime.steps_done, await self.step_evidence(runtime))
        try:
            downloaded = await download_state(
                await self.dht.replicate_p2p(),
                source,
                request,
                timeout_s=self.averaging_timeout_s * 4,
                max_bytes=state_bytes_bound(runtime),
            )
        except (TimeoutError, CheckpointError, ProtocolError, OSError) as e:
            raise ProtocolError(f"could not load the state of replica {source[-8:]} to catch up: {e}") from None
        if downloaded[0].steps_done > bound:
            raise ProtocolError(
                f"replica {source[-8:]} sent a state of {downloaded[0].steps_done} steps, more than any other live "
                f"peer of the run announces ({bound - STEP_SLACK:.0f}): not loading it"
            )

        def load() -> bool:
            if outer:  # the rounds the source applied, at least those this replica has (anchors apart)
                if averaging.rounds_of_state(downloaded[2].get(REPLICA_STATE_KEY)) < averaging.outer_rounds:
                    return False
            elif downloaded[0].steps_done <= runtime.steps_done:
                return False
            if drop_gradients:
                runtime.discard_accumulated()
            runtime.import_state(downloaded, self.model, f"state from replica {source[-8:]}")
            return True

        if outer:
            self.outer.cancel()  # this replica's rounds in flight began from the anchor it drops
        if not await asyncio.get_running_loop().run_in_executor(self.compute, load):
            return
        logger.info(
            f"stage {runtime.stage}: caught up with replica {source[-8:]} after missing an averaging round "
            f"({runtime.steps_done} steps done)"
        )

    def remember_members(self, records: Iterable[PeerRecord]) -> None:
        """Peers seen holding a peer credential for their stage (a move's plan, a standby's look, a
        donor search): in a run with an authority, a move asks them for state too if their record
        lapsed a moment later (they are `seen_replicas`), as it asks any seen peer without one."""
        if self.authority is None:
            return
        now = time.monotonic()
        for record in records:
            if credentialed_records([record], self.authority, stage=record.stage):
                self._members_seen.pop(record.peer_id, None)
                self._members_seen[record.peer_id] = (record.stage, now)
        while len(self._members_seen) > 4096:
            self._members_seen.pop(next(iter(self._members_seen)))

    def _seen_member(self, peer_id: str, stage: int) -> bool:
        seen = self._members_seen.get(peer_id)
        return seen is not None and seen[0] == stage and time.monotonic() - seen[1] < MEMBER_MEMORY_S

    async def live_records(self, runtime) -> list[PeerRecord]:
        """The other live replicas of `runtime`'s stage that may be donors: online, of the same split,
        and in a run with an authority holding a peer credential for the stage."""
        records = [
            r
            for r in await fetch_stage_records_async(self.dht, self.model, runtime.stage)
            if r.state == PeerState.ONLINE and r.peer_id != self.peer_id and r.num_stages == runtime.num_stages
        ]
        if self.authority is not None:
            records = credentialed_records(records, self.authority, stage=runtime.stage)
            self.remember_members(records)
        return records

    async def step_evidence(self, runtime) -> dict[str, int]:
        """The steps each other live peer of the run may hold by now, by its record (`steps_by_now`),
        on any stage (every trainer step commits to every stage, so a chain's stages hold the same
        count): what bounds a donor's step count. Counting other stages too lets a lone honest
        replica's state through when the other replicas of its stage joined a moment ago."""
        stages = await asyncio.gather(
            *[fetch_stage_records_async(self.dht, self.model, stage) for stage in range(runtime.num_stages)]
        )
        evidence: dict[str, int] = {}
        now = get_dht_time()
        for stage, records in enumerate(stages):
            live = [
                r
                for r in records
                if r.state == PeerState.ONLINE and r.peer_id != self.peer_id and r.num_stages == runtime.num_stages
            ]
            if self.authority is not None:
                live = credentialed_records(live, self.authority, stage=stage)
            for r in live:
                steps = steps_by_now(r.steps_done, r.steps_per_s, r.announced_at, r.expires_at, now)
                evidence[r.peer_id] = max(evidence.get(r.peer_id, 0), steps)
        return evidence

    async def load_state_from_replica(self, p2p, runtime=None, seen_replicas: Iterable[str] = ()) -> bool:
        """Before going online: copy the stage's current state from live replicas, if there are any,
        never on one donor's word (peers/replicas/donor_choice.py): up to MAX_DONORS of them, asked in
        a random order, say what they would send (steps and digest); the state most of them agree on
        within the step counts the DHT shows is downloaded, and checked against its digest. In a run
        with an authority, only replicas holding a peer credential for the stage are asked.
        `runtime`: load into this one instead of the served one (a move or a standby refresh).
        `seen_replicas`: peers a moment ago seen online at that stage (the snapshot a move was planned
        on, a standby's last look); each is asked too, after the replicas the DHT shows now, as its
        record may have lapsed for a moment on a loaded machine (then a mover found none and served
        its new stage from initial weights); in a run with an authority, those seen holding a peer
        credential for the stage (`remember_members`) only.
        Returns whether a replica's state was loaded."""
        runtime = runtime or self.serving.runtime
        records = await self.live_records(runtime)
        announced = await self.step_evidence(runtime)
        sources = shuffled([r.peer_id for r in records], self.rng)
        seen = [p for p in seen_replicas if self.authority is None or self._seen_member(p, runtime.stage)]
        sources += [p for p in shuffled(seen, self.rng) if p not in sources and p != self.peer_id]
        request = StateRequest(
            model=self.model, stage=runtime.stage, num_stages=runtime.num_stages, credential=self.credential
        )
        for attempt in range(2):  # a donor that stepped between its offer and the download: ask again once
            offers = await self._offers(p2p, sources[:MAX_DONORS], request)
            donors = choose_donors(offers, runtime.steps_done, announced)
            for reason in refusals(offers, runtime.steps_done, announced):
                print(f"not loading stage {runtime.stage} state: replica {reason}", flush=True)
            for donor in donors:
                try:
                    downloaded = await download_state(
                        p2p,
                        donor.peer_id,
                        request,
                        timeout_s=self.averaging_timeout_s * 4,
                        max_bytes=state_bytes_bound(runtime),
                        expected_digest=donor.digest,
                    )
                    await asyncio.get_running_loop().run_in_executor(
                        self.compute,
                        runtime.import_state,
                        downloaded,
                        self.model,
                        f"state from replica {donor.peer_id[-8:]}",
                    )
                except (TimeoutError, CheckpointError, ProtocolError, OSError) as e:
                    logger.warning(f"Could not load state from {donor.peer_id[-8:]}: {e}; trying another replica")
                    continue
                except Exception as e:  # the replica may vanish mid-transfer in many ways
                    logger.warning(f"Could not load state from {donor.peer_id[-8:]}: {type(e).__name__}: {e}")
                    continue
                agreed = f", as {len(donors)} replicas offered" if len(donors) > 1 else ""
                print(
                    f"loaded stage {runtime.stage} state from replica {donor.peer_id[-8:]} "
                    f"({runtime.steps_done} steps done{agreed})",
                    flush=True,
                )
                return True
            if not donors:
                break
        if sources:
            print(f"no replica of stage {runtime.stage} could send its state; starting from what we have", flush=True)
        return False

    async def _offers(self, p2p, sources: list[str], request: StateRequest) -> list[StateOffer]:
        """What each of `sources` would send, asked at once; those that do not answer are left out."""
        results = await asyncio.gather(
            *[fetch_offer(p2p, peer_id, request, timeout_s=self.averaging_timeout_s) for peer_id in sources],
            return_exceptions=True,
        )
        offers = []
        for peer_id, result in zip(sources, results):
            if isinstance(result, StateOffer):
                offers.append(result)
            elif isinstance(result, Exception):  # dead or unreachable replicas fail in assorted ways
                logger.warning(f"Could not ask {peer_id[-8:]} for its state: {type(result).__name__}: {result}")
            else:
                raise result
        return offers

    async def sync_replicas(self, *, max_age_s: float = 5.0, modes: tuple[str, ...] = ("sync",)) -> frozenset[str]:
        """The peers whose records say they are replicas of this stage averaging in one of `modes`
        now (the records read at most every `max_age_s`; 0: read now)."""
        runtime = self.serving.runtime
        key = (runtime.stage, runtime.num_stages)
        cached = self._sync_replicas
        if cached is None or cached[0] != key or time.monotonic() - cached[1] >= max_age_s:
            records = await fetch_stage_records_async(self.dht, self.model, runtime.stage)
            online = tuple(r for r in records if r.state == PeerState.ONLINE and r.num_stages == runtime.num_stages)
            cached = self._sync_replicas = (key, time.monotonic(), online)
        return frozenset(r.peer_id for r in cached[2] if r.averaging in modes)

    async def bounded_group_size(self, group_size: int) -> int:
        """A commit's group size, at most the replicas this one could average with (the members, with
        a run authority; else the averaging replicas the DHT shows), itself included. A round
        waits for its group until its timeout, on the compute thread: a commit declaring 4,096
        replicas froze stage 1's compute for 30 s (issue #60)."""
        if group_size <= 1:
            return group_size
        if self.members is not None:
            return min(group_size, len(self.members.members) + 1)
        return min(group_size, len(await self.sync_replicas(modes=("sync", "periodic", "outer")) | {self.peer_id}))

    async def check_named_group(self, commit: CommitRequest) -> None:
        """A commit that names its group (sync, `samples`) without a run authority names only sync
        replicas of this stage that the DHT shows (read again once if some are missing: one may have
        joined a moment ago); ProtocolError otherwise. A round waits for every peer it names: a commit
        naming 4,095 made-up peers held this replica's compute thread for the round's whole timeout
        (30 s, issue #60); with a run authority the member list refuses such a group at once."""
        named = set(commit.samples) - {self.peer_id}
        modes = (getattr(getattr(self.serving, "averaging", None), "mode", "sync"),)  # sync, or periodic by steps
        unknown = named - await self.sync_replicas(modes=modes)
        if unknown:
            unknown -= await self.sync_replicas(max_age_s=0.0, modes=modes)
        if unknown:
            raise ProtocolError(
                f"the commit names {len(unknown)} peer(s) that are no {modes[0]} replica of stage "
                f"{self.serving.runtime.stage} ({', '.join(sorted(p[-8:] for p in unknown)[:4])})"
            )

    async def periodic_group_size(self) -> int:
        """Replicas of this stage online in periodic mode, as the DHT shows them, this one included."""
        runtime = self.serving.runtime
        records = await fetch_stage_records_async(self.dht, self.model, runtime.stage)
        group = [
            r
            for r in records
            if r.state == PeerState.ONLINE and r.averaging == "periodic" and r.num_stages == runtime.num_stages
        ]
        return len({r.peer_id for r in group} | {self.peer_id})

    def _print_round(self, outcome) -> None:
        print(
            f"averaged parameters with {outcome.group_size - 1} other replica(s) (round {self.serving.averaging.rounds}"
            f"{', then an outer step' if outcome.outer_stepped else ''}; {self.serving.runtime.steps_done} steps done)",
            flush=True,
        )

    async def average_parameters_forever(self, stop: asyncio.Event) -> None:
        """Periodic mode by time: meet the other replicas at every multiple of the period (DHT time)."""
        while not stop.is_set():
            averaging = self.serving.averaging  # a move swaps it (with the runtime)
            round_time = averaging.next_round_time()
            delay = max(round_time - get_dht_time() - 1.0, 0.0)  # join matchmaking a second early
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
                return
            except TimeoutError:
                pass
            group_size = await self.periodic_group_size()
            loop = asyncio.get_running_loop()
            # Matchmaking runs in the averager's process while this stage keeps computing; only the
            # all-reduce itself, which writes the parameters, takes the compute thread.
            control = await loop.run_in_executor(None, averaging.schedule, group_size, round_time)
            if control is not None:
                deadline = time.monotonic() + self.averaging_timeout_s
                while not averaging.group_ready(control) and time.monotonic() < deadline and not stop.is_set():
                    await asyncio.sleep(0.05)
                if averaging.group_ready(control):
                    outcome = await loop.run_in_executor(self.compute, averaging.average, control)
                    if outcome.averaged:
                        self._print_round(outcome)
                else:
                    averaging.abandon(control)
            await asyncio.sleep(1.0)


def by_time(averaging) -> bool:
    """Periodic averaging on a clock: its rounds follow no commit (nor the group one names)."""
    return isinstance(averaging, ParameterAveraging) and not averaging.rounds_schedule.by_steps


def with_named_round(averaging, commit: CommitRequest, call):
    """`call()` on the compute thread, the commit's way of averaging handed to `averaging` first: its
    gloo rendezvous (if any), and whether it asks for a round by exchange."""
    averaging.rendezvous, averaging.exchanged = commit.gloo_rendezvous, commit.sync_exchange
    return call()
