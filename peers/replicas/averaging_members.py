"""Who may average with a stage's replicas, and how much each may weigh.

`MemberAverager` is hivemind's `DecentralizedAverager` with these checks, applied in the averager's
own process:

- membership: with a member list (a run with an authority, dht/authority.py), only listed peers may
  join a group this replica leads, send it parts or download its state, and a group naming anyone
  else is abandoned before any tensor moves. `AveragingMembers` keeps the list: peers whose signed
  DHT record carries a peer credential of the run for this stage.
- whole rounds only: a round that lost a partner's part fails instead of leaving a replica
  half-averaged (`reduce_whole_parts_only`, `_exchange_with`), and fails fast (`_end`, `_refuse`).
- weight caps: a part weighs at most the samples the trainer saw its sender serve
  (`CommitRequest.samples`), or, where the trainer counted nothing, the group's `median_weight`.
- groups named by the trainer (`--averaging-groups trainer`): a sync commit names its group
  (`named_group_id`), so the round skips hivemind's matchmaking.
- robust reduction (`RobustPartReducer`, peers/replicas/robust_mean.py); where three or more
  replicas are live (`expect_group`), a group of two is abandoned.

Without a member list, anyone may join, as with hivemind's own averager.
Why each check exists, with what it cost before: docs/design/replicas.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing's AsyncIterator in RPC hints

import hivemind
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartReducer
from hivemind.compression import CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, aiter_with_timeout, amap_in_executor, anext, as_aiter, azip

from dht.announce import fetch_stage_records_async
from dht.authority import RunAuthority, credentialed_records
from dht.records import PeerRecord
from peers.replicas.robust_mean import MIN_ROBUST_GROUP, robust_mean, robust_mean_by_segment, segment_lengths

logger = logging.getLogger(__name__)

MIN_WEIGHT = 1e-9  # weight 0 for every sender would divide by zero; a tiny one changes nothing
NAMED_GROUP_MARK = b"swarm-named:"  # the start of a group id built from a commit, not by matchmaking
NAMED_GROUP_WAIT_S = 10.0  # how long a part of a named group waits for this replica to begin its round
ENDED_GROUPS_KEPT = 64  # the latest rounds over here, whose late parts are answered with an error at once
REFUSAL_DRAIN_S = 5.0  # how long a refused part's stream is read, for its sender to take the answer first


def named_group_id(step_id: str, peer_ids: Collection[str]) -> bytes:
    """The id of the group a commit names: the same on every replica the commit reaches, and a new
    one for each step (and each retry of it, which has its own step id)."""
    digest = hashlib.sha256("\n".join([step_id, *sorted(peer_ids)]).encode()).digest()[:16]
    return NAMED_GROUP_MARK + digest


def part_size_for_group(num_values: int, group_size: int, bytes_per_value: float, part_size_bytes: int) -> int:
    """hivemind's part size for a round over one buffer of `num_values`: at most `part_size_bytes`,
    and small enough that the buffer makes at least two parts per member. hivemind gives each member
    the parts that fall in its share; with parts as large as the whole buffer (`tiny`'s gradients,
    34,624 values, are a quarter of one 512 KiB part) one member reduced everything and the other
    nothing. The latter then never contacted the former, so a round it refused left the former
    waiting for its parts until the round's timeout (tests/integration/test_named_groups.py)."""
    most_values = max(1, num_values // (2 * max(group_size, 1)))
    return max(1, min(part_size_bytes, math.floor(most_values * bytes_per_value)))


def capped_weight(weight: float, cap: float | None) -> float:
    """A sender's weight in the average: what it declared, at most its cap (None: no cap)."""
    if cap is None:
        return weight
    return max(min(weight, cap), MIN_WEIGHT)


def median_weight(declared: Sequence[Any]) -> float:
    """The lower median of the weights a group's members declared (anything but a positive finite
    number counts as MIN_WEIGHT): the most a member weighs where the trainer counted nothing for it.
    The lower one, so that in a pair the larger declaration weighs what the smaller does."""
    weights = sorted(
        float(w) if isinstance(w, (int, float)) and MIN_WEIGHT < float(w) < float("inf") else MIN_WEIGHT
        for w in declared
    )
    return weights[(len(weights) - 1) // 2] if weights else MIN_WEIGHT


def declared_weights(group_info: GroupInfo, serializer) -> list[Any]:
    """What each member of a group declared in matchmaking as its weight (hivemind's gathered
    `[bandwidth, mode, user data]`, the user data being the weight `ReplicaAveraging` gathers);
    None for a member whose declaration cannot be read."""
    declared = []
    for data in group_info.gathered:
        try:
            declared.append(serializer.loads(serializer.loads(data)[2]))
        except Exception:  # msgpack raises assorted errors on a member's garbage: it weighs MIN_WEIGHT here
            declared.append(None)
    return declared


def credentialed_members(
    records: Collection[PeerRecord], authority: RunAuthority, *, stage: int, now: float | None = None
) -> frozenset[str]:
    """The peer ids among `records` whose own record carries a valid peer credential for `stage`."""
    return frozenset(r.peer_id for r in credentialed_records(records, authority, stage=stage, now=now))


class _SenderParts:
    """What hivemind's reducer uses as its accumulator for one part (`add_` for each sender, then
    `div_` by the total weight once all have sent), keeping the parts to reduce them robustly."""

    def __init__(self, reducer: RobustPartReducer):
        self.reducer = reducer
        self.parts: list = []
        self.weights: list[float] = []

    def add_(self, part, alpha: float = 1.0) -> _SenderParts:
        # a weight must be positive and finite for the bound to hold: a sender's 0, negative, NaN or
        # infinite weight weighs (almost) nothing
        self.parts.append(part)
        self.weights.append(alpha if MIN_WEIGHT < alpha < float("inf") else MIN_WEIGHT)
        return self

    def div_(self, denominator: float):
        return self.reducer.reduce(self.parts, self.weights)


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer of this replica's parts, reducing each part robustly over its senders
    (`method`, peers/replicas/robust_mean.py) instead of summing them as they arrive, and counts
    the parts where a sender was clipped. A part with fewer than three senders gets the plain mean.
    `part_segments`: for each part, the lengths of its pieces that lie in different tensors of a flat
    buffer, each reduced on its own (None: every part is reduced whole)."""

    def __init__(self, part_shapes, num_senders: int, *, method: str, part_segments: list[list[int]] | None = None):
        self.method = method
        self.part_segments = part_segments
        self.parts_clipped = 0
        self.parts_reduced = 0
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _SenderParts(self)

    def reduce(self, parts: list, weights: list[float]):
        self.parts_reduced += 1
        if len(parts) < MIN_ROBUST_GROUP:
            return robust_mean(parts, weights, "none").value
        if self.part_segments is None:
            reduced = robust_mean(parts, weights, self.method)
        else:
            reduced = robust_mean_by_segment(parts, weights, self.part_segments[self.current_part_index], self.method)
        if reduced.clipped:
            self.parts_clipped += 1
        return reduced.value


def reduce_whole_parts_only(reducer: TensorPartReducer, caps: list[float] | None = None) -> None:
    """Make `reducer` average each sender's part with its weight capped (`caps`, by sender index;
    None: as declared), and fail every part averaged without a sender that stopped midway.

    hivemind's reducer drops a sender whose stream broke (it bans it) and averages the rest of its
    parts over the others: the groupmates then step on an average that left a replica's gradient
    out of some parts, and report success. Here the reducer answers such a part with an error
    instead, to this replica and to every groupmate, so the round fails everywhere (the trainer
    then commits the step again) rather than passing a partial average as a whole one."""
    accumulate = reducer.accumulate_part

    async def whole(sender_index: int, part_index: int, tensor_part, weight: float = 1.0):
        if caps is not None:
            weight = capped_weight(weight, caps[sender_index])
        averaged = await accumulate(sender_index, part_index, tensor_part, weight=weight)
        left_out = sum(after <= part_index for after in reducer.sender_failed_after)
        if left_out:
            raise AllreduceException(
                f"part {part_index} was averaged without {left_out} groupmate(s) that stopped sending midway"
            )
        return averaged

    reducer.accumulate_part = whole


class _CappedRunner(AllReduceRunner):
    """hivemind's all-reduce, whose reducer averages each sender's part with its weight capped,
    robustly unless `robust` is "none", and whole parts only; whose senders hold their stream open
    until every averaged part is back. `tensor_sizes`: the tensors that the one averaged tensor (a flat
    buffer) holds, which the robust reduction reduces one by one."""

    def __init__(
        self,
        *args,
        weight_caps: Mapping[str, float] | None = None,
        robust: str = "none",
        tensor_sizes: Sequence[int] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if robust != "none":
            replaced = self.tensor_part_reducer
            replaced.finished.set()  # unused: its finalization would warn that it received no parts
            self.tensor_part_reducer = RobustPartReducer(
                replaced.part_shapes,
                replaced.num_senders,
                method=robust,
                part_segments=None if tensor_sizes is None else self._segments_of_own_parts(tensor_sizes),
            )
        caps = None if weight_caps is None else [weight_caps.get(p.to_base58(), 0.0) for p in self.sender_peer_ids]
        reduce_whole_parts_only(self.tensor_part_reducer, caps)

    def _segments_of_own_parts(self, tensor_sizes: Sequence[int]) -> list[list[int]]:
        """For each part this replica reduces, its pieces in each of `tensor_sizes` (a flat buffer's
        tensors). hivemind cuts the buffer into parts that are views of it, so a part's offset in the
        buffer is its storage offset."""
        if len(self.tensor_part_container.local_tensors) != 1:
            raise ValueError("tensor sizes describe one flat buffer; this round averages several tensors")
        own = self.tensor_part_container._input_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        return [segment_lengths(part.storage_offset(), part.numel(), tensor_sizes) for part, _ in own]

    async def _communicate_with_peer(self, peer_id: PeerID):
        """Send this replica's part for `peer_id` to reduce and read back the averaged part: hivemind's
        exchange, except that the request stream stays open until every averaged part has arrived.

        hivemind ends its request stream as soon as the last part is sent, so the partner's handler
        returns, and its stream closes, right after it has written its last answer. Over p2pd that
        close raced the answer's tail: under load the tail was lost ("sent 10 parts, but we expected
        11"), and a round that one replica completed failed on the other (seen in CI; the trainer
        then repaired it with a state download). Here the partner cannot close before this replica
        has read all it expects. A sender in client mode, whose results the reducer holds back until
        it has sent everything, keeps hivemind's exchange. Why a part was lost is logged as a
        warning (hivemind logs it at debug level; the round then fails, `_run_allreduce_inplace_`)."""
        try:
            if peer_id == self.peer_id:
                await self._reduce_own_part()
            elif self.should_delay_results(self.peer_id):
                await super()._communicate_with_peer(peer_id)
            else:
                await self._exchange_with(peer_id)
        except Exception as e:
            # registered as failed (its parts keep their local values and `_run_allreduce_inplace_`
            # fails the round); raised, hivemind's run() would only log it at debug level
            whose = "this replica's own part" if peer_id == self.peer_id else f"the averaged part from {peer_id}"
            logger.warning(f"All-reduce: {whose} was lost: {type(e).__name__}: {e}")

    async def _handle_missing_senders(self):
        """hivemind's bans the senders that have not begun within `sender_timeout`; without one (ours)
        it waited for every sender forever and banned nobody, and run() waited on it at its end, so a
        round in which a groupmate never sent (it failed first) never finished its run()."""
        if self.sender_timeout is not None:
            await super()._handle_missing_senders()

    async def _reduce_own_part(self) -> None:
        """hivemind's reduction of the part this replica holds, which does not expect to fail: a part
        averaged without a groupmate (`reduce_whole_parts_only`) fails it, and the parts left are
        marked failed, so that the round ends (failed) instead of waiting for them until its timeout."""
        try:
            await super()._communicate_with_peer(self.peer_id)
        except Exception:
            self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(self.peer_id))
            raise

    async def _exchange_with(self, peer_id: PeerID) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        received_all = asyncio.Event()

        async def parts_then_wait():
            async for message in self._generate_input_for_peer(peer_index):
                yield message
            await received_all.wait()  # the end of the stream, only once every answer is here

        def deserialize(message: averaging_pb2.AveragingData):
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            return deserialize_torch_tensor(message.tensor_part)

        received = 0
        try:
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(parts_then_wait())
            answers = aiter_with_timeout(stream, self.reducer_timeout)
            async for delta in amap_in_executor(deserialize, answers, max_prefetch=self.tensor_part_container.prefetch):
                if received >= expected:
                    raise AllreduceException(f"peer {peer_id} sent more than the {expected} parts expected")
                self.tensor_part_container.register_processed_part(peer_index, received, delta)
                received += 1
                if received == expected:
                    received_all.set()
            if received != expected:
                raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
        except Exception:
            self.tensor_part_container.register_failed_reducer(peer_index)
            if peer_id in self.sender_peer_ids:
                # its parts will most likely not come either, and this round has failed here anyway:
                # end it now (the parts this replica reduces then fail, `reduce_whole_parts_only`)
                # instead of waiting for them until the round's timeout
                await self._ban_sender(peer_id)
            raise
        except BaseException:
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        finally:
            received_all.set()


async def _refuse(code: int, stream: AsyncIterator[averaging_pb2.AveragingData]):
    """A part's error answer, then what the sender still sends read and dropped until it ends its
    stream (at most `REFUSAL_DRAIN_S`). Returning at once closed the stream right behind the answer,
    and over p2pd that close can drop an answer the sender had not read yet (wire/bounded_streams.py);
    the sender then waited for its round's timeout (seen once in CI: test_named_groups, 60 s)."""
    yield averaging_pb2.AveragingData(code=code)
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REFUSAL_DRAIN_S):
            async for _ in stream:
                pass


class MemberAverager(hivemind.averaging.DecentralizedAverager):
    """hivemind's averager with a member list, weight caps and a robust reduction (see the module's
    docstring). `robust`: one of peers/replicas/robust_mean.py's ROBUST_METHODS."""

    def __init__(
        self,
        *args,
        members: Collection[str] | None = None,
        robust: str = "none",
        tensor_sizes: Sequence[int] | None = None,
        **kwargs,
    ):
        """`tensor_sizes`: where the one averaged tensor is a flat buffer of several, their sizes in
        order; the robust reduction then reduces each tensor's values on their own."""
        # set first: with start=True, hivemind's __init__ forks the averager's process itself
        self._members = None if members is None else frozenset(members)
        self._robust = robust
        self._tensor_sizes = None if tensor_sizes is None else tuple(tensor_sizes)
        self._weight_caps: dict[str, float] | None = None
        self._expected_group = 0  # replicas the next rounds expect (`expect_group`); 0: not said
        self._named_group: tuple[bytes, dict[str, float]] | None = None  # the next round's, if named
        # parts of a named group that came before this replica began its round, waiting for it
        self._early_parts: dict[bytes, list[asyncio.Future]] = {}
        # the latest rounds over here, or refused (`_end`): their parts are answered with an error
        self._ended_groups: deque[bytes] = deque(maxlen=ENDED_GROUPS_KEPT)
        # Off: hivemind's state sharing (`load_state_from_peers`), which nothing here uses (a replica
        # catches up through the peer's own state download). With it on, the averager declares itself
        # on the DHT again as soon as a round updates its tensors: DHT stores every round, which took
        # more CPU than the all-reduce itself (benchmarks/RESULTS.md, "A round's DHT stores").
        kwargs.setdefault("allow_state_sharing", False)
        super().__init__(*args, **kwargs)

    # --- set from the peer's process (through the averager's pipe, like hivemind's own setters) ---
    def set_members(self, members: Collection[str]) -> None:
        self._members = frozenset(members)
        self._outer_pipe.send(("_set_members", [], dict(members=self._members)))

    def set_weight_caps(self, caps: Mapping[str, float] | None) -> None:
        self._outer_pipe.send(("_set_weight_caps", [], dict(caps=None if caps is None else dict(caps))))

    def expect_group(self, size: int) -> None:
        """The replicas the next rounds expect (the live ones): with a robust reduction and three or
        more expected, a group of two is abandoned (a pair gets the plain mean, so a liar that keeps
        looking for a partner and leads a group of two would move its partner halfway to its value)."""
        self._outer_pipe.send(("_expect_group", [], dict(size=int(size))))

    async def _expect_group(self, size: int) -> None:
        self._expected_group = size

    def name_next_group(self, group_id: bytes | None, weights: Mapping[str, float] | None = None) -> None:
        """The group of the next `step` (sent before it, through the same pipe, so it arrives first):
        these peers (this one included) with these weights, instead of matchmaking; None: matchmaking."""
        named = None if group_id is None else (group_id, dict(weights or {}))
        self._outer_pipe.send(("_name_next_group", [], dict(named=named)))

    async def _name_next_group(self, named: tuple[bytes, dict[str, float]] | None) -> None:
        self._named_group = named

    def _group_named(self, step, group_id: bytes, weights: dict[str, float]) -> GroupInfo:
        """The group a commit named, as hivemind's matchmaking would have returned it: the peers in
        one order every member computes alike, each with hivemind's gather data (this replica's own
        as it declared it, the others' weight as the trainer counted it, all at the default bandwidth)."""
        me = self.peer_id.to_base58()
        peer_ids = sorted(set(weights) | {me})

        def gathered(peer: str) -> bytes:
            if peer == me:
                return step.data_for_gather
            user_data = self.serializer.dumps(float(weights[peer]))
            return self.serializer.dumps([None, AveragingMode.NODE.value, user_data])

        return GroupInfo(group_id, tuple(PeerID.from_base58(p) for p in peer_ids), tuple(map(gathered, peer_ids)))

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's stop, then this process's client of p2pd closed. hivemind never closes it:
        the averager's process then ends with its client socket (`/tmp/hivemind-p2pclient-*.sock`)
        left behind, one per averager that ever ran."""
        try:
            await super()._shutdown(timeout)
        finally:
            await self._p2p.shutdown()

    async def _set_members(self, members: frozenset[str]) -> None:
        self._members = members

    async def _set_weight_caps(self, caps: dict[str, float] | None) -> None:
        self._weight_caps = caps

    # --- the checks, in the averager's process -----------------------------------------------------
    def _is_member(self, context) -> bool:
        return self._members is None or context.remote_id.to_base58() in self._members

    @property
    def _matchmaking(self):
        try:
            return self.__dict__["_member_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking) -> None:
        """hivemind sets its matchmaking in the averager's process; this one never asks an outsider to
        lead it. Without it, a replica without a credential that declares itself leader (any peer of
        an open run may serve, and looks for a group under the stage's key) draws the members into its
        group, which they then abandon: no round completes while it keeps declaring (measured: every
        commit of both honest replicas failed after a 30 s wait, benchmarks/attacks.py)."""
        request_join = matchmaking._request_join_group

        async def request_join_members_only(leader):
            if self._members is not None and leader.to_base58() not in self._members:
                return None  # as a leader that turned us away: the search goes on to the next
            return await request_join(leader)

        matchmaking._request_join_group = request_join_members_only
        look_for_group = matchmaking.look_for_group

        async def look_for_named_group(step):
            named, self._named_group = self._named_group, None
            if named is None or self.mode != AveragingMode.NODE:
                return await look_for_group(step)
            return self._group_named(step, *named)

        matchmaking.look_for_group = look_for_named_group
        self.__dict__["_member_matchmaking"] = matchmaking

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self._is_member(context):
            logger.warning(f"Refused an averaging join from {context.remote_id}: not a member of this run's stage")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        request = await anext(stream)
        refusal = await self._refusal_of(request.group_id, context)
        if refusal is None:
            try:
                async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
                    yield message
                return
            except AllreduceException:  # the round it waited for was refused meanwhile (`_end`)
                refusal = averaging_pb2.CANCELLED
        async for message in _refuse(refusal, stream):
            yield message

    async def _refusal_of(self, group_id: bytes, context: P2PContext) -> int | None:
        """The code a part of round `group_id` from the caller is refused with, or None to reduce it."""
        named = group_id.startswith(NAMED_GROUP_MARK)
        if not named and not self._is_member(context):
            return averaging_pb2.PROTOCOL_VIOLATION
        if named and group_id not in self._running_groups and group_id not in self._ended_groups:
            # a groupmate of a named group may begin before this replica has: wait a while for our
            # round to register it (hivemind would answer BAD_GROUP_ID at once, failing the sender's).
            # The member list is checked after: it is refreshed as the round begins, so a replica
            # that joined since is known by then (checked first, it failed their first round).
            await self._wait_for_group(group_id, min(self._allreduce_timeout or NAMED_GROUP_WAIT_S, NAMED_GROUP_WAIT_S))
        if not self._is_member(context):
            return averaging_pb2.PROTOCOL_VIOLATION
        if group_id in self._ended_groups:  # refused, failed or done: nothing will reduce this part
            return averaging_pb2.CANCELLED
        return None

    async def _wait_for_group(self, group_id: bytes, timeout_s: float) -> None:
        """Until this replica registers `group_id` (`_register_allreduce_group`), or `timeout_s`."""
        registered = asyncio.get_running_loop().create_future()
        waiting = self._early_parts.setdefault(group_id, [])
        waiting.append(registered)
        try:
            await asyncio.wait_for(registered, timeout_s)
        except TimeoutError:
            pass
        finally:
            if registered in waiting:
                waiting.remove(registered)
            if not waiting and self._early_parts.get(group_id) is waiting:
                del self._early_parts[group_id]

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo):
        """hivemind's, which also wakes the parts of this group that came early (`_wait_for_group`),
        and answers those that come after the round with an error at once (`_end`)."""
        try:
            with super()._register_allreduce_group(group_info):
                for registered in self._early_parts.pop(group_info.group_id, []):
                    if not registered.done():
                        registered.set_result(None)
                yield
        finally:
            self._end(group_info.group_id)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not self._is_member(context):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    def _end(self, group_id: bytes) -> None:
        """The round of `group_id` is over here, or will not run (refused): its groupmates' parts,
        those waiting for it and those still to come, are answered with an error at once. hivemind
        has no message for it: they waited for this replica's parts until their round's timeout
        (30 s), or `NAMED_GROUP_WAIT_S` for the round to begin."""
        if group_id not in self._ended_groups:
            self._ended_groups.append(group_id)
        for waiting in self._early_parts.pop(group_id, []):
            if not waiting.done():
                waiting.set_result(None)
        registered = self._running_groups.get(group_id)
        if registered is not None and not registered.done():
            registered.set_exception(AllreduceException("this replica abandoned the round"))
            registered.exception()  # retrieved here: a handler that awaits it later gets it too

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        if self._robust != "none" and len(group_info.peer_ids) < MIN_ROBUST_GROUP <= self._expected_group:
            self._end(group_info.group_id)
            raise MatchmakingException(
                f"a group of {len(group_info.peer_ids)} where {self._expected_group} replicas are live: "
                f"robust averaging needs {MIN_ROBUST_GROUP}"
            )
        if self._members is not None:
            outsiders = [p for p in group_info.peer_ids if p != self.peer_id and p.to_base58() not in self._members]
            if outsiders:
                self._end(group_info.group_id)
                raise MatchmakingException(f"the group holds {len(outsiders)} peer(s) without a credential of this run")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind's own (averager.py), with the capped runner, and parts small enough for every
        member to reduce some of one flat buffer (`part_size_for_group`)."""
        group_id = group_info.group_id if group_id is None else group_id
        if len(tensors) == 1:
            (flat,) = tensors
            infos = kwargs.get("tensor_infos") or (CompressionInfo.from_tensor(flat, key=0),)
            codec = kwargs.get("compression") or NoCompression()
            kwargs["part_size_bytes"] = part_size_for_group(
                flat.numel(),
                len(group_info.peer_ids),
                flat.element_size() * codec.estimate_compression_ratio(infos[0]),
                kwargs.get("part_size_bytes", DEFAULT_PART_SIZE_BYTES),
            )
        caps = self._weight_caps
        if caps is None:  # the trainer counted nothing for the members: each at most the group's median
            cap = median_weight(declared_weights(group_info, self.serializer))
            caps = {peer.to_base58(): cap for peer in group_info.peer_ids}
        runner = _CappedRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            weight_caps=caps,
            robust=self._robust,
            tensor_sizes=self._tensor_sizes,
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
            reducer = runner.tensor_part_reducer
            if isinstance(reducer, RobustPartReducer) and reducer.parts_clipped:
                logger.warning(
                    f"Robust averaging ({self._robust}) clipped a sender's contribution in {reducer.parts_clipped} "
                    f"of the {reducer.parts_reduced} part(s) this replica reduced (a groupmate far from the others)"
                )
            parts = runner.tensor_part_container
            if parts.failed_size:  # hivemind keeps the local values of a part whose reducer failed
                raise AllreduceException(
                    f"a partner failed to return its averaged part: {parts.failed_size} of {parts.total_size} "
                    f"values kept their local value; the round counts as failed"
                )
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")


class AveragingMembers:
    """Keeps a stage's member list fresh from the DHT: every `period_s`, and at once when a commit
    names more replicas than the list holds (a replica that joined since). `averager()`: the stage's
    averaging now (a move swaps it), anything with `set_members`, or None. With `recognize` (a
    private run), the credentialed peers of every stage are passed to it too, with how long to
    trust them (the admission guard then serves them the RPCs that carry no credential: probes)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        authority: RunAuthority,
        *,
        model: str,
        peer_id: str,
        stage: Callable[[], int],
        averager: Callable[[], Any],
        period_s: float = 5.0,
        num_stages: int = 1,
        recognize: Callable[[Collection[str], float], None] | None = None,
    ):
        self.dht, self.authority, self.model, self.peer_id = dht, authority, model, peer_id
        self.stage, self.averager, self.period_s = stage, averager, period_s
        self.num_stages, self.recognize = num_stages, recognize
        self.members: frozenset[str] = frozenset()
        self._refreshed_at = 0.0

    async def refresh(self) -> frozenset[str]:
        stage = self.stage()
        stages = range(self.num_stages) if self.recognize is not None else [stage]
        fetched = await asyncio.gather(*[fetch_stage_records_async(self.dht, self.model, s) for s in stages])
        by_stage = dict(zip(stages, fetched))
        members = credentialed_members(by_stage.get(stage, []), self.authority, stage=stage) - {self.peer_id}
        if self.recognize is not None:
            known = {r.peer_id for s, rs in by_stage.items() for r in credentialed_records(rs, self.authority, stage=s)}
            self.recognize(known, time.time() + 3 * self.period_s)
        averager = self.averager()
        if averager is not None:  # every time: a move may have swapped the averager for a new one
            averager.set_members(members)
        self.members, self._refreshed_at = members, time.monotonic()
        return members

    async def refresh_if_short(self, group_size: int) -> None:
        """Before a round of `group_size` replicas (this one included): refresh if some are unknown."""
        if group_size - 1 > len(self.members) and time.monotonic() - self._refreshed_at > 0.5:
            await self.refresh()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.refresh()
            except Exception as e:  # the DHT may be slow; the next refresh tries again
                logger.warning(f"Could not refresh the averaging members: {type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.period_s)
            except TimeoutError:
                pass
