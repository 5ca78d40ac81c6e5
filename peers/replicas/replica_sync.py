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
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from functools import partial

import hivemind
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from dht.announce import fetch_stage_records_async
from dht.records import PeerState
from peers.compute.checkpoint import CheckpointError
from peers.replicas.averaging import GradientSync, ParameterAveraging
from peers.replicas.averaging_members import AveragingMembers
from peers.replicas.delayed_sync import DelayedGradientSync
from peers.replicas.state_transfer import StateExports, download_state, state_bytes_bound
from peers.serving.admission import caller_id
from peers.serving.serving_state import ServingState
from wire.messages import read_unary, unary_response, write_state
from wire.protocol import CommitRequest, CommitResponse, ProtocolError, StateHeader, StateRequest

logger = logging.getLogger(__name__)


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
        follower=None,
    ):
        """`authorize(caller, credential, action, stage=...)`: raises unless the caller may (the
        admission guard's); `credential`: this peer's own, presented when it downloads state;
        `follower`: the run's spec (peers/serving/run_follower.py), whose version a commit names."""
        self.serving, self.compute, self.dht = serving, compute, dht
        self.peer_id, self.model, self.averaging_timeout_s = peer_id, model, averaging_timeout_s
        self.state_exports = StateExports()  # rate-limited per caller, serialized once per step
        self.authorize = authorize or (lambda *args, **kwargs: None)
        self.credential = credential
        self.members = members  # a run with an authority: who may average with us, kept fresh
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
        try:
            commit = read_unary(request, CommitRequest)
            self.authorize(caller_id(context), commit.credential, "train")
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
                    commit.catch_up_from, to_steps=commit.catch_up_to, drop_gradients=commit.catch_up_drops_gradients
                )
                return unary_response(CommitResponse(steps_done=serving.runtime.steps_done))
            if self.members is not None:  # a replica that joined since the last refresh is let in now
                await self.members.refresh_if_short(commit.group_size)
            if self.follower is not None and commit.spec_version:
                # the step follows the spec version the trainer names, so its replicas step on one schedule
                if not await self.follower.ensure(commit.spec_version):
                    raise ProtocolError(
                        f"this peer has not found version {commit.spec_version} of run {self.follower.run_id}'s "
                        f"spec (it knows version {self.follower.version})"
                    )
                serving.runtime.follow_schedule(self.follower.schedule(commit.spec_version))
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
                    call = partial(averaging.prepare, commit.step_id, commit.group_size, commit.samples, **flush)
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
                outcome = await loop.run_in_executor(
                    self.compute, averaging.commit, commit.step_id, commit.group_size, commit.samples
                )
            elif isinstance(averaging, ParameterAveraging) and averaging.rounds_schedule.by_steps:
                # the round, if one follows this step, is sized for the replicas we see online (as by time)
                group_size = await self.periodic_group_size() if averaging.round_due_after_next_step() else 1
                outcome = await loop.run_in_executor(self.compute, averaging.commit, commit.step_id, group_size)
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
        return unary_response(response)

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
            refusal = self.state_exports.refusal(caller_id(context))
            if refusal is not None:
                raise ProtocolError(refusal)
            data, steps_done = await self.state_exports.export(serving.runtime, self.model, self.compute)
            header = StateHeader(total_bytes=len(data), steps_done=steps_done)
        except ProtocolError as e:
            header, data = StateHeader(error=str(e)), b""
        for message in write_state(header, data):
            yield message

    async def catch_up(self, source: str, *, to_steps: int | None = None, drop_gradients: bool = True) -> None:
        """Sync averaging's repair (the trainer asks for it): this replica missed a round that `source`,
        a replica of the same stage, completed, so the replicas' parameters parted. Load its state
        (parameters, optimizer state and step count) on the compute thread, before the next step's
        forwards; with `drop_gradients`, first drop the accumulated gradients, which `source`'s update
        holds already. Nothing is done when this replica has done `to_steps` steps (what the trainer
        saw `source` at) already, and nothing is loaded that is not ahead of this replica: with several
        trainers, two may ask for the same repair, or a round may have moved both replicas on since."""
        runtime = self.serving.runtime
        if to_steps is not None and runtime.steps_done >= to_steps:
            return
        request = StateRequest(
            model=self.model, stage=runtime.stage, num_stages=runtime.num_stages, credential=self.credential
        )
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

        def load() -> bool:
            if downloaded[0].steps_done <= runtime.steps_done:
                return False
            if drop_gradients:
                runtime.discard_accumulated()
            runtime.import_state(downloaded, self.model, f"state from replica {source[-8:]}")
            return True

        if not await asyncio.get_running_loop().run_in_executor(self.compute, load):
            return
        logger.info(
            f"stage {runtime.stage}: caught up with replica {source[-8:]} after missing an averaging round "
            f"({runtime.steps_done} steps done)"
        )

    async def load_state_from_replica(self, p2p, runtime=None, seen_replicas: Iterable[str] = ()) -> bool:
        """Before going online: copy the stage's current state from a live replica, if there is one.
        `runtime`: load into this one instead of the served one (a move or a standby refresh).
        `seen_replicas`: peers a moment ago seen online at that stage (the snapshot a move was planned
        on, a standby's last look); each is asked too, after the replicas the DHT shows now, as its
        record may have lapsed for a moment on a loaded machine (then a mover found none and served
        its new stage from initial weights). Returns whether a replica's state was loaded."""
        runtime = runtime or self.serving.runtime
        records = [
            r
            for r in await fetch_stage_records_async(self.dht, self.model, runtime.stage)
            if r.state == PeerState.ONLINE and r.peer_id != self.peer_id and r.num_stages == runtime.num_stages
        ]
        sources = [r.peer_id for r in sorted(records, key=lambda r: r.load)]
        sources += [p for p in dict.fromkeys(seen_replicas) if p not in sources and p != self.peer_id]
        request = StateRequest(
            model=self.model, stage=runtime.stage, num_stages=runtime.num_stages, credential=self.credential
        )
        for source in sources:
            try:
                downloaded = await download_state(
                    p2p,
                    source,
                    request,
                    timeout_s=self.averaging_timeout_s * 4,
                    max_bytes=state_bytes_bound(runtime),
                )
                # Compared with the runtime that receives the state (a move's new stage, not the one served so far).
                if downloaded[0].steps_done < runtime.steps_done:  # e.g. a replica that served little or nothing
                    print(
                        f"replica {source[-8:]} has done {downloaded[0].steps_done} steps, fewer than our "
                        f"{runtime.steps_done}; not loading its state",
                        flush=True,
                    )
                    continue
                await asyncio.get_running_loop().run_in_executor(
                    self.compute,
                    runtime.import_state,
                    downloaded,
                    self.model,
                    f"state from replica {source[-8:]}",
                )
                print(
                    f"loaded stage {runtime.stage} state from replica {source[-8:]} ({runtime.steps_done} steps done)",
                    flush=True,
                )
                return True
            except (TimeoutError, CheckpointError, ProtocolError, OSError) as e:
                logger.warning(f"Could not load state from {source[-8:]}: {e}; trying another replica")
            except Exception as e:  # the replica may vanish mid-transfer in many ways
                logger.warning(f"Could not load state from {source[-8:]}: {type(e).__name__}: {e}")
        if sources:
            print(f"no replica of stage {runtime.stage} could send its state; starting from what we have", flush=True)
        return False

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
