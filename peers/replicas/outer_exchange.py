"""Outer rounds over the network (`--averaging outer`): the commit that drives them, and the
all-gather of the members' pseudo-gradients (RPC_OUTER_ROUND).

A round's members are the replicas the trainer committed the step on (`CommitRequest.samples`:
every member gets the same list), this one included. Each member sends its payload (one fragment's
pseudo-gradient, encoded once, outer_averaging.py) to every other member and waits for theirs; every
member then holds the same payloads and computes the same outer step (outer_rounds.py). The round
counts on a member when every other member accepted its payload and it received every other one's,
each naming the same members (`group`) and the same anchor as its own; otherwise it fails there,
and since every member checks the same, it fails everywhere (a dead member: its payload never
comes, and sending to it fails fast). A failed round loses no progress (outer_rounds.py).
One that fails on one side only (an acceptance lost on the way back) leaves the anchors apart: the
commit's answers carry each replica's round count and anchor digest, and the trainer has the one
behind load another's state (`CommitRequest.catch_up_rounds`).

hivemind's averager is not involved: no averager process, no matchmaking. Payloads that arrive
before this replica has begun the round wait in an inbox (a few rounds, one payload per sender,
each checked against the stage, the fragment's size and the run's credentials first).

The commit, on the peer's event loop (its tensor work on the compute thread): the local step; the
overlapped rounds due now, awaited and applied; then the rounds that begin now, encoded and sent;
without overlap they are awaited and applied before the commit is answered, with overlap they run
in the background until their own commit, H / F steps later.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Collection
from concurrent.futures import Executor
from dataclasses import dataclass

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from peers.compute.compute_thread import STEP, submit_at
from peers.replicas.outer_averaging import Begun, OuterAveraging, OuterOutcome
from peers.replicas.outer_rounds import Contribution
from peers.serving.admission import caller_id
from wire.bounded_streams import StreamLimits, iterate_bounded
from wire.compression import EncodedTensor
from wire.messages import read_request, read_response, unary_response, write_request, write_response
from wire.protocol import RPC_OUTER_ROUND, OuterRoundRequest, OuterRoundResponse, ProtocolError
from wire.tensors import group_parts

logger = logging.getLogger(__name__)

PAYLOAD = "pseudo_gradient"
INBOX_ROUNDS = 8  # rounds whose early payloads a replica keeps


def group_digest(members: Collection[str]) -> str:
    return hashlib.sha256("\n".join(sorted(set(members))).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Arrived:
    sender: str
    header: OuterRoundRequest
    payload: EncodedTensor


class OuterInbox:
    """Payloads from other members, by round ((fragment, begun_after)), until the round takes them."""

    def __init__(self, max_rounds: int = INBOX_ROUNDS):
        self.max_rounds = max_rounds
        self.rounds: dict[tuple[int, int], dict[str, Arrived]] = {}
        self.changed = asyncio.Event()

    def put(self, key: tuple[int, int], arrived: Arrived) -> str | None:
        """Keep `arrived`; the reason it is refused, or None."""
        if key not in self.rounds and len(self.rounds) >= self.max_rounds:
            oldest = min(self.rounds)
            if key < oldest:
                return "this round is older than every round this replica keeps"
            del self.rounds[oldest]  # a round that never began here: its payloads are of no use
        held = self.rounds.setdefault(key, {})
        if arrived.sender in held:
            return "a payload of this round from this sender came already"
        held[arrived.sender] = arrived
        self.changed.set()
        return None

    async def collect(self, key: tuple[int, int], senders: Collection[str], timeout_s: float) -> dict[str, Arrived]:
        """The payloads of `senders` for round `key`, waiting up to `timeout_s` for them; as many as came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        wanted = set(senders)
        while True:
            held = self.rounds.get(key, {})
            if wanted <= set(held) or loop.time() >= deadline:
                break
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=max(deadline - loop.time(), 0.0))
            except TimeoutError:
                pass
        held = self.rounds.pop(key, {})
        for stale in [k for k in self.rounds if k[0] == key[0] and k[1] <= key[1]]:
            del self.rounds[stale]
        return {s: a for s, a in held.items() if s in wanted}


class OuterExchange:
    """The peer's side of outer rounds: the RPC that receives payloads, and the commit."""

    def __init__(
        self,
        *,
        averaging: Callable[[], object],
        p2p: Callable,
        peer_id: str,
        model: str,
        compute: Executor,
        authorize: Callable[..., None] | None = None,
        credential: str | None = None,
    ):
        """`averaging()`: the stage's averaging now (a move swaps it); `p2p()`: awaitable, this
        process's P2P; `authorize(caller, credential, action, stage=...)`: the admission guard's."""
        self.averaging, self.p2p, self.peer_id, self.model = averaging, p2p, peer_id, model
        self.compute = compute
        self.authorize = authorize or (lambda *args, **kwargs: None)
        self.credential = credential
        self.inbox = OuterInbox()
        self.pending: dict[int, tuple[int, asyncio.Task]] = {}  # fragment -> (begun after, its exchange)

    # --- receiving ------------------------------------------------------------------------------------
    @staticmethod
    def refused(error: Exception, waited_s: float):
        return [unary_response(OuterRoundResponse(error=str(error)))]

    async def rpc_outer_round(self, requests, context):
        try:
            self.accept(await read_request(requests, OuterRoundRequest), caller_id(context))
            answer = OuterRoundResponse(accepted=True)
        except ProtocolError as e:
            answer = OuterRoundResponse(error=str(e))
        for message in write_response(answer):
            yield message

    def accept(self, received, sender: str) -> None:
        header = received.header
        averaging = self.averaging()
        if not isinstance(averaging, OuterAveraging):
            raise ProtocolError("this replica does not take outer rounds")
        runtime = averaging.runtime
        self.authorize(sender, header.credential, "average", stage=runtime.stage)
        if (header.model, header.stage, header.num_stages) != (self.model, runtime.stage, runtime.num_stages):
            raise ProtocolError(f"this peer serves {self.model} stage {runtime.stage}/{runtime.num_stages}")
        if averaging.members is not None and sender not in averaging.members:
            raise ProtocolError("the sender is not a member of this stage's replicas")
        if not 0 <= header.fragment < averaging.schedule.fragments:
            raise ProtocolError(f"this stage's rounds have {averaging.schedule.fragments} fragment(s)")
        start, stop = averaging.state.bounds[header.fragment]
        tensors = group_parts(header.tensors, received.parts)
        payload = tensors.get(PAYLOAD)
        if payload is None or len(tensors) != 1:
            raise ProtocolError(f"an outer round carries one tensor, {PAYLOAD!r}")
        if payload.header.shape != (stop - start,) or payload.header.dtype != "float32":
            raise ProtocolError(f"fragment {header.fragment} holds {stop - start} float32 values")
        every = averaging.schedule.every_steps
        if abs(header.begun_after - runtime.steps_done) > 2 * every:
            raise ProtocolError(
                f"round after step {header.begun_after} is far from this replica's {runtime.steps_done}"
            )
        refusal = self.inbox.put((header.fragment, header.begun_after), Arrived(sender, header, payload))
        if refusal is not None:
            raise ProtocolError(refusal)

    # --- sending ----------------------------------------------------------------------------------------
    async def send(self, peer: str, header: OuterRoundRequest, payload: EncodedTensor, timeout_s: float) -> str | None:
        """Send one payload to one member; why it was not accepted, or None."""
        try:
            p2p = await self.p2p()

            async def call():
                stream = await iterate_bounded(
                    p2p,
                    PeerID.from_base58(peer),
                    RPC_OUTER_ROUND,
                    write_request(header, [(PAYLOAD, payload)]),
                    runtime_pb2.ExpertResponse,
                    StreamLimits(read_timeout_s=timeout_s + 5.0),
                )
                return (await read_response(stream, OuterRoundResponse)).header

            answer = await asyncio.wait_for(call(), timeout=timeout_s)
        except TimeoutError:
            return "timed out"
        except Exception as e:  # noqa: BLE001 - any failure to deliver fails the round
            return f"{type(e).__name__}: {e}"
        return None if answer.accepted else (answer.error or "refused")

    async def exchange(self, averaging: OuterAveraging, begun: Begun, members: list[str]) -> list[Contribution] | None:
        """One round's all-gather; every member's contribution (this one's first), or None."""
        runtime = averaging.runtime
        fragment, begun_after = begun.round.fragment, begun.round.begun_after
        others = [p for p in members if p != self.peer_id]
        group = group_digest(members)
        own = Contribution(self.peer_id, begun.weight, begun.round.payload)
        if not others:
            averaging.record(True, 1, 0, 0)
            return [own]
        header = OuterRoundRequest(
            model=self.model,
            stage=runtime.stage,
            num_stages=runtime.num_stages,
            fragment=fragment,
            begun_after=begun_after,
            group=group,
            anchor=begun.anchor,
            weight=begun.weight,
            credential=self.credential,
        )
        timeout = averaging.timeout_s
        sent = await asyncio.gather(*[self.send(p, header, begun.round.payload, timeout) for p in others])
        failures = [f"{p[-8:]}: {why}" for p, why in zip(others, sent) if why is not None]
        arrived = await self.inbox.collect((fragment, begun_after), others, 0.0 if failures else timeout)
        missing = [p[-8:] for p in others if p not in arrived]
        mismatched = [
            a.sender[-8:] for a in arrived.values() if a.header.group != group or a.header.anchor != begun.anchor
        ]
        nbytes = begun.round.payload.nbytes
        received = sum(a.payload.nbytes for a in arrived.values())
        if failures or missing or mismatched:
            if not averaging.closing:
                logger.warning(
                    f"stage {runtime.stage}: outer round of fragment {fragment} after step {begun_after} failed "
                    f"({'; '.join(failures) or 'sent'}; missing {missing or 'none'}; other members or anchor "
                    f"{mismatched or 'none'}); its progress goes with the next round"
                )
            averaging.record(False, len(members), nbytes * (len(others) - len(failures)), received)
            return None
        averaging.record(True, len(members), nbytes * len(others), received)
        return [own] + [Contribution(a.sender, a.header.weight, a.payload) for a in arrived.values()]

    # --- the commit ---------------------------------------------------------------------------------
    async def commit(self, averaging: OuterAveraging, step_id: str, members: Collection[str]) -> OuterOutcome:
        loop = asyncio.get_running_loop()
        outcome = await asyncio.wrap_future(submit_at(self.compute, STEP, averaging.local_step, step_id))
        if outcome is None:
            return averaging.outcomes[step_id]
        members = sorted(set(members) | {self.peer_id})
        steps_done, schedule = outcome.steps_done, averaging.schedule
        applied = failed = 0
        for fragment, (begun_after, task) in sorted(self.pending.items()):
            if schedule.applied_after(begun_after) <= steps_done:
                del self.pending[fragment]
                ok = await self._apply(averaging, fragment, begun_after, await outcome_of(task))
                applied, failed = applied + ok, failed + (not ok)
        for fragment in schedule.begins_after(steps_done):
            if fragment in self.pending:  # not yet applied (a step count that jumped: a loaded state)
                self.pending.pop(fragment)[1].cancel()
            begun = await loop.run_in_executor(self.compute, averaging.begin, fragment, steps_done)
            task = asyncio.create_task(self.exchange(averaging, begun, members))
            if schedule.overlap:
                self.pending[fragment] = (steps_done, task)
            else:
                ok = await self._apply(averaging, fragment, steps_done, await outcome_of(task))
                applied, failed = applied + ok, failed + (not ok)
        result = OuterOutcome(
            True,
            outcome.samples,
            steps_done,
            applied=applied,
            failed=failed,
            group_size=len(members),
            pending=bool(self.pending),
        )
        return averaging.remember(step_id, result)

    async def flush(self, averaging: OuterAveraging) -> OuterOutcome:
        """After the trainer's last step: the overlapped rounds in flight, awaited and applied."""
        applied = failed = 0
        for fragment, (begun_after, task) in sorted(self.pending.items()):
            ok = await self._apply(averaging, fragment, begun_after, await outcome_of(task))
            applied, failed = applied + ok, failed + (not ok)
        self.pending.clear()
        return OuterOutcome(False, 0, averaging.runtime.steps_done, applied=applied, failed=failed)

    async def _apply(self, averaging: OuterAveraging, fragment: int, begun_after: int, contributions) -> bool:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.compute, averaging.finish, fragment, contributions, begun_after)

    def cancel(self) -> None:
        """A move or the peer's stop: the rounds in flight are dropped (their progress stays local)."""
        for _, task in self.pending.values():
            task.cancel()
        self.pending.clear()


async def outcome_of(task: asyncio.Task) -> list[Contribution] | None:
    """A round's exchange, or None (a failed round) when it was cancelled (a catch-up dropped it) or broke."""
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # the commit itself is being cancelled: pass it on
            raise
        return None
    except Exception as e:  # noqa: BLE001 - the round fails; the commit goes on
        logger.warning(f"an outer round's exchange broke: {type(e).__name__}: {e}")
        return None
