"""Averaging without a network: traffic accounting, its metrics, what a failed sync round does, and
periodic averaging by steps (a step on every commit, a round after every K-th, none lost)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import types

import pytest
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartContainer
from hivemind.compression import CompressionInfo
from hivemind.proto import averaging_pb2

from models.config import get_model_config
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from peers.metrics import PeerMetrics
from peers.replicas import averaging_members
from peers.replicas.averaging import (
    COMPRESSIONS,
    AveragingRound,
    GradientSync,
    ParameterAveraging,
    allreduce_bytes_each_way,
    common_dtype,
    shaped_like,
    wire_bytes_per_value,
)
from peers.replicas.averaging_members import named_group_id, part_size_for_group
from peers.replicas.averaging_schedule import AveragingSchedule
from peers.replicas.delayed_sync import DelayedGradientSync


def test_a_replica_alone_moves_nothing_and_a_pair_moves_its_whole_tensor_each_way():
    assert allreduce_bytes_each_way(1000, 1, 4.0) == 0
    # two replicas: half of our tensor goes out and comes back averaged, the other's copy of our
    # half comes in and goes back as a difference: 1000 values out and 1000 in
    assert allreduce_bytes_each_way(1000, 2, 4.0) == 4000
    assert allreduce_bytes_each_way(1000, 4, 2.0) == 3000  # 2 * 3/4 * 1000 values at 2 bytes


@pytest.mark.parametrize("codec, low, high", [("none", 4.0, 4.01), ("fp16", 2.0, 2.01), ("int8", 1.0, 1.05)])
def test_the_codecs_serialized_size_per_value_is_measured(codec, low, high):
    tensors = [torch.randn(256, 256), torch.randn(1024)]
    assert low <= wire_bytes_per_value(COMPRESSIONS[codec](), tensors) <= high


def test_a_flat_buffer_is_seen_as_one_view_per_parameter_in_order():
    params = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 2)]
    flat = torch.zeros(sum(p.numel() for p in params))
    views = shaped_like(flat, params)
    assert [v.shape for v in views] == [p.shape for p in params]
    for view, param in zip(views, params):
        view.copy_(param)  # writes land in the flat buffer, in the parameters' order
    torch.testing.assert_close(flat, torch.cat([p.reshape(-1) for p in params]))
    with pytest.raises(ValueError, match="cannot hold"):
        shaped_like(torch.zeros(20), params)


def test_a_flat_buffer_takes_the_parameters_dtype_or_float32_where_they_mix():
    assert common_dtype([torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]) == torch.bfloat16
    assert common_dtype([torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3)]) == torch.float32


def test_averaging_rounds_and_bytes_are_counted_per_mode():
    m = PeerMetrics()
    m.set_averaging_mode("periodic")
    r = m.registry
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "periodic", "result": "ok"}) == 0
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "sync", "result": "ok"}) is None
    m.observe_averaging_round(AveragingRound("periodic", ok=True, group_size=2, sent_bytes=400, received_bytes=400))
    m.observe_averaging_round(AveragingRound("periodic", ok=True, group_size=3, sent_bytes=500, received_bytes=500))
    m.observe_averaging_round(AveragingRound("periodic", ok=False, group_size=0, sent_bytes=0, received_bytes=0))
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "periodic", "result": "ok"}) == 2
    assert r.get_sample_value("swarm_peer_averaging_rounds_total", {"mode": "periodic", "result": "failed"}) == 1
    for direction in ("sent", "received"):
        assert (
            r.get_sample_value("swarm_peer_averaging_bytes_total", {"mode": "periodic", "direction": direction}) == 900
        )
    assert r.get_sample_value("swarm_peer_averaging_group_size", {"mode": "periodic"}) == 3


def test_a_peer_without_averaging_shows_no_averaging_series():
    m = PeerMetrics()
    m.set_averaging_mode("none")
    samples = [s for f in m.registry.collect() if f.name.startswith("swarm_peer_averaging") for s in f.samples]
    assert samples == []


class _ControlledSync(GradientSync):
    """GradientSync without a DHT: each round's outcome is set by the test."""

    def __init__(self, runtime: StageRuntime, round_result):
        self.runtime, self.committed, self.round_result = runtime, set(), round_result
        self.named_groups = False
        self.outcomes = collections.OrderedDict()
        runtime.auto_step = False
        self.averager = self  # get_tensors() below stands in for the averager's shared buffers
        self.buffers = [torch.zeros_like(p) for p in runtime.params]

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffers

    def _all_reduce(self, group_size: int, weight: float, named=None):
        return self.round_result(weight)

    def set_weight_caps(self, caps):
        self.caps = caps


def _runtime_with_gradients() -> StageRuntime:
    runtime = StageRuntime(get_model_config("tiny"), 0, 2, optimizer=OptimizerSettings(optimizer="sgd", lr=0.1))
    runtime.auto_step = False
    inputs = torch.randint(0, 256, (2, runtime.config.seq_len))
    grad_outputs = torch.randn(2, runtime.config.seq_len, runtime.config.d_model)
    runtime.backward("mb0", inputs, grad_outputs=grad_outputs)
    return runtime


def test_a_failed_sync_round_does_not_step_and_keeps_the_gradients_for_the_next_commit():
    runtime = _runtime_with_gradients()
    before = [p.detach().clone() for p in runtime.params]
    sync = _ControlledSync(runtime, round_result=lambda weight: None)
    outcome = sync.commit("run:0", group_size=2)
    assert not outcome.stepped and runtime.steps_done == 0 and runtime.samples_accumulated == 2
    assert all(torch.equal(p, b) for p, b in zip(runtime.params, before))
    sync.round_result = lambda weight: {"self": weight, "other": 2.0}  # the next round works
    outcome = sync.commit("run:1", group_size=2)
    assert outcome.stepped and outcome.samples == 4 and runtime.steps_done == 1
    # a retried commit (or another trainer's of the same global step) does not step twice, and is
    # answered with the first one's outcome
    assert sync.commit("run:1", group_size=2) == outcome and runtime.steps_done == 1


class _ControlledPeriodic(ParameterAveraging):
    """ParameterAveraging by steps without a DHT: each round's outcome is set by the test."""

    def __init__(self, runtime: StageRuntime, every_steps: int, round_result):
        self.runtime, self.rounds_schedule, self.outer = runtime, AveragingSchedule(every_steps=every_steps), None
        self.committed, self.round_result, self.rounds_tried = set(), round_result, []
        self.named_groups, self.named = False, []
        runtime.auto_step = False
        self.averager = self  # get_tensors() below stands in for the averager's lock
        self.buffers = [torch.zeros_like(p) for p in runtime.params]

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffers

    def _all_reduce(self, group_size: int, weight: float, named=None):
        self.rounds_tried.append((self.runtime.steps_done, group_size))
        self.named.append(named)
        return self.round_result()


def test_periodic_by_steps_steps_on_every_commit_and_averages_after_every_kth():
    runtime = _runtime_with_gradients()
    averaging = _ControlledPeriodic(runtime, every_steps=2, round_result=lambda: {"self": 1.0, "other": 1.0})
    first = averaging.commit("run:0", group_size=2)
    assert first.stepped and not first.averaged and runtime.steps_done == 1 and averaging.rounds_tried == []
    second = averaging.commit("run:1", group_size=2)  # no sample this time: the step still counts
    assert second.stepped and second.samples == 0 and runtime.steps_done == 2
    assert second.averaged and averaging.rounds_tried == [(2, 2)]
    assert averaging.commit("run:1", group_size=2).stepped is False and runtime.steps_done == 2  # a retry


def test_periodic_by_steps_averages_in_the_group_the_commit_names():
    """Issue #60: a member the trainer never committed to (a credentialed averager joining the
    stage's matchmaking) broke every round, each held to its timeout while the trainer waited. By
    steps, the round's group is the replicas the commit names: no matchmaking, equal weights, one
    group id for the K-th step on every replica (whichever trainer's commit it was)."""
    runtime = _runtime_with_gradients()
    averaging = _ControlledPeriodic(runtime, every_steps=1, round_result=lambda: {"me": 1.0, "b": 1.0, "c": 1.0})
    averaging.named_groups, averaging.peer_id = True, types.SimpleNamespace(to_base58=lambda: "me")
    averaging.commit("run:0", group_size=5, replicas=["me", "b", "c"])
    group_id, weights = averaging.named[0]
    assert weights == {"me": 1.0, "b": 1.0, "c": 1.0} and averaging.rounds_tried == [(1, 3)]  # not the 5 it saw
    assert group_id == named_group_id("periodic:1", ["c", "b", "me"])
    averaging.commit("run:1", group_size=2, replicas=["b", "c"])  # a list without this replica: matchmaking
    averaging.commit("run:2", group_size=2, replicas=None)  # a commit that names nobody: matchmaking
    assert averaging.named[1:] == [None, None]
    averaging.named_groups = False  # --averaging-groups matchmaking
    averaging.commit("run:3", group_size=3, replicas=["me", "b", "c"])
    assert averaging.named[3] is None


def test_a_failed_periodic_round_keeps_the_local_step_and_a_lone_replica_does_not_try():
    runtime = _runtime_with_gradients()
    before = [p.detach().clone() for p in runtime.params]
    averaging = _ControlledPeriodic(runtime, every_steps=1, round_result=lambda: None)  # no partner came
    outcome = averaging.commit("run:0", group_size=2)
    assert outcome.stepped and not outcome.averaged and runtime.steps_done == 1 and runtime.samples_accumulated == 0
    assert not all(torch.equal(p, b) for p, b in zip(runtime.params, before))  # the step was not lost
    alone = averaging.commit("run:1", group_size=1)
    assert alone.stepped and not alone.averaged and averaging.rounds_tried == [(1, 2)]


class _ControlledDelayed(DelayedGradientSync):
    """DelayedGradientSync without a DHT: a round 'averages' this replica's buffers with nobody's
    (they keep its own mean); whether it succeeds, and with what weights, is set by the test."""

    def __init__(self, runtime: StageRuntime, round_result):
        self.runtime, self.committed, self.round_result, self.in_flight = runtime, set(), round_result, None
        self.outcomes, self.held, self.named_groups = collections.OrderedDict(), None, False
        runtime.auto_step = False
        self.averager = self
        self.buffers = [torch.zeros_like(p) for p in runtime.params]
        self.weights: list[float] = []  # each round's weight, as started
        self.prepared, self.exact_rounds, self.exact_steps = None, 0, 0

    def _all_reduce(self, group_size: int, weight: float, named=None):  # an exact step's round
        self.exact_rounds += 1
        return self.round_result(weight)

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffers

    def set_weight_caps(self, caps):
        self.caps = caps

    def begin_round(self, group_size: int, weight: float, *args, **kwargs):
        self.weights.append(weight)
        return weight  # stands in for the round's control

    def finish_round(self, control):
        return self.round_result(control)

    def record_failure(self) -> None:
        pass


def _accumulate(runtime: StageRuntime, microbatch_id: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 256, (2, runtime.config.seq_len), generator=generator)
    grad_outputs = torch.randn(2, runtime.config.seq_len, runtime.config.d_model, generator=generator)
    runtime.backward(microbatch_id, inputs, grad_outputs=grad_outputs)


def test_a_delayed_commit_answers_at_once_and_applies_the_update_at_the_next_commit():
    runtime = _runtime_with_gradients()
    initial = [p.detach().clone() for p in runtime.params]
    first = [g.clone() for g in runtime.local_mean_gradients()]
    sync = _ControlledDelayed(runtime, round_result=lambda weight: {"self": weight, "other": 2.0})
    outcome = sync.commit("run:0", group_size=2)
    assert outcome.pending and not outcome.stepped and runtime.steps_done == 0 and runtime.samples_accumulated == 0
    assert all(torch.equal(p, b) for p, b in zip(runtime.params, initial))  # step 1 computes on these
    _accumulate(runtime, "mb1", seed=1)
    outcome = sync.commit("run:1", group_size=2)
    assert outcome.pending and outcome.stepped and outcome.averaged and outcome.samples == 4
    assert runtime.steps_done == 1
    for param, before, gradient in zip(runtime.params, initial, first):  # SGD at lr 0.1 on step 0's gradient
        torch.testing.assert_close(param.detach(), before - 0.1 * gradient, atol=1e-6, rtol=0)
    assert sync.commit("run:1", group_size=2).stepped is False and runtime.steps_done == 1  # a retry
    flushed = sync.commit("run:flush", group_size=2, flush=True)
    assert flushed.stepped and not flushed.pending and runtime.steps_done == 2 and sync.in_flight is None
    assert sync.commit("run:flush2", group_size=2, flush=True).stepped is False  # nothing left to apply


def test_a_failed_delayed_round_carries_its_gradients_into_the_next_round():
    runtime = _runtime_with_gradients()
    results = iter([None, {"self": 4.0, "other": 4.0}])
    sync = _ControlledDelayed(runtime, round_result=lambda weight: next(results))
    sync.commit("run:0", group_size=2)
    _accumulate(runtime, "mb1", seed=1)
    outcome = sync.commit("run:1", group_size=2)  # step 0's round failed: nothing applied, still pending
    assert not outcome.stepped and outcome.pending and runtime.steps_done == 0
    assert runtime.samples_accumulated == 2  # step 0's gradients, back in the accumulation
    _accumulate(runtime, "mb2", seed=2)
    sync.commit("run:2", group_size=2)
    assert sync.weights == [2.0, 2.0, 4.0]  # step 2's round carries step 0's samples along


def test_a_lone_delayed_replica_steps_one_commit_late_too():
    runtime = _runtime_with_gradients()
    sync = _ControlledDelayed(runtime, round_result=lambda weight: pytest.fail("a lone replica has no round"))
    assert sync.commit("run:0", group_size=1).stepped is False and runtime.steps_done == 0
    assert sync.commit("run:1", group_size=1).stepped and runtime.steps_done == 1


def test_the_delay_begins_after_the_exact_steps_and_stays():
    """`--sync-delay-from 2`: the stage's first two steps take the exact barrier (stepped at their own
    commit), the third commit starts the delay; a failed exact round keeps the stage exact."""
    runtime = _runtime_with_gradients()
    runtime.weight_prediction = "last-update"
    results = iter([None, {"self": 2.0, "other": 2.0}, {"self": 4.0, "other": 2.0}])
    sync = _ControlledDelayed(runtime, round_result=lambda weight: next(results, {"self": weight, "other": 2.0}))
    sync.exact_steps = 2
    failed = sync.commit("run:0", group_size=2)  # exact, and its round failed: no step, still exact
    assert not failed.stepped and not failed.pending and runtime.steps_done == 0 and sync.exact_rounds == 1
    first = sync.commit("run:1", group_size=2)
    assert first.stepped and not first.pending and runtime.steps_done == 1 and sync.in_flight is None
    assert runtime.predicted_update is None  # an exact step computes on the parameters, not a guess
    _accumulate(runtime, "mb2", seed=2)
    last_exact = sync.commit("run:2", group_size=2)
    assert last_exact.stepped and runtime.steps_done == 2 and sync.exact_rounds == 3
    _accumulate(runtime, "mb3", seed=3)
    late = sync.commit("run:3", group_size=2)  # two steps taken: the delay begins
    assert late.pending and not late.stepped and runtime.steps_done == 2 and sync.weights == [2.0]
    assert sync.commit("run:2", group_size=2) == last_exact  # a retry of the last exact commit: its answer
    _accumulate(runtime, "mb4", seed=4)
    assert sync.commit("run:4", group_size=2).stepped and runtime.steps_done == 3 and sync.exact_rounds == 3
    assert sync.commit("run:flush", group_size=2, flush=True).stepped and runtime.steps_done == 4


def test_a_clipped_exact_step_before_the_delay_is_applied_at_its_own_commit():
    runtime = _runtime_with_gradients()
    initial = [p.detach().clone() for p in runtime.params]
    first = [g.clone() for g in runtime.local_mean_gradients()]
    sync = _ControlledDelayed(runtime, round_result=lambda weight: {"self": weight, "other": 2.0})
    sync.exact_steps = 1
    prepared = sync.prepare("run:0", group_size=2)
    assert not prepared.pending and prepared.grad_norm_sq is not None
    assert sync.apply_prepared("run:0:apply", 0.5).stepped and runtime.steps_done == 1
    for param, before, gradient in zip(runtime.params, initial, first):  # SGD at lr 0.1 on half of it
        torch.testing.assert_close(param.detach(), before - 0.1 * 0.5 * gradient, atol=1e-6, rtol=0)
    _accumulate(runtime, "mb1", seed=1)
    late = sync.prepare("run:1", group_size=2)  # the delay: nothing to apply yet
    assert late.pending and late.grad_norm_sq is None
    assert not sync.apply_prepared("run:1:apply", 1.0).stepped and runtime.steps_done == 1


def test_a_delayed_clipped_commit_holds_the_previous_update_and_applies_it_scaled():
    """Clipping with the delay: "prepare" ends the round in flight and holds its update (answering
    its squared norm), "apply" steps on it times the trainer's scale; the flush clips the last one."""
    runtime = _runtime_with_gradients()
    initial = [p.detach().clone() for p in runtime.params]
    first = [g.clone() for g in runtime.local_mean_gradients()]
    sync = _ControlledDelayed(runtime, round_result=lambda weight: {"self": weight, "other": 2.0})
    prepared = sync.prepare("run:0", group_size=2)
    assert prepared.pending and not prepared.stepped and prepared.grad_norm_sq is None  # no update yet
    assert sync.apply_prepared("run:0:apply", 1.0).stepped is False and runtime.steps_done == 0
    _accumulate(runtime, "mb1", seed=1)
    second = [g.clone() for g in runtime.local_mean_gradients()]
    prepared = sync.prepare("run:1", group_size=2)
    assert prepared.pending and not prepared.stepped and runtime.steps_done == 0  # held, not applied
    assert prepared.grad_norm_sq == pytest.approx(float(sum(g.double().pow(2).sum() for g in first)), rel=1e-6)
    assert sync.prepare("run:1", group_size=2) == prepared  # a retry gets the same answer
    applied = sync.apply_prepared("run:1:apply", 0.25)
    assert applied.stepped and runtime.steps_done == 1
    for param, before, gradient in zip(runtime.params, initial, first):  # SGD at lr 0.1 on a quarter of it
        torch.testing.assert_close(param.detach(), before - 0.1 * 0.25 * gradient, atol=1e-6, rtol=0)
    assert sync.apply_prepared("run:1:apply", 0.25) == applied and runtime.steps_done == 1  # a retry
    flushed = sync.prepare("run:flush", group_size=2, flush=True)
    assert not flushed.pending and sync.in_flight is None
    assert flushed.grad_norm_sq == pytest.approx(float(sum(g.double().pow(2).sum() for g in second)), rel=1e-6)
    assert sync.apply_prepared("run:flush:apply", 1.0).stepped and runtime.steps_done == 2


def test_a_refused_part_is_answered_first_and_its_stream_read_until_the_sender_ends_it():
    """A refusal that returned at once closed the stream right behind its answer; over p2pd that can
    drop the answer unread, and the sender waited for its round's timeout. The answer comes first,
    then the sender's parts are read (and dropped) until it ends its stream, or for a bounded time."""

    async def main():
        events = []

        async def parts(count: int, then_hang: bool = False):
            for i in range(count):
                events.append(f"read {i}")
                yield averaging_pb2.AveragingData()
            if then_hang:
                await asyncio.sleep(3600)

        async for message in averaging_members._refuse(averaging_pb2.CANCELLED, parts(3)):
            events.append(averaging_pb2.MessageCode.Name(message.code))
        assert events == ["CANCELLED", "read 0", "read 1", "read 2"]

        averaging_members.REFUSAL_DRAIN_S, kept = 0.2, averaging_members.REFUSAL_DRAIN_S
        try:
            answers = [m.code async for m in averaging_members._refuse(averaging_pb2.CANCELLED, parts(1, True))]
        finally:
            averaging_members.REFUSAL_DRAIN_S = kept
        assert answers == [averaging_pb2.CANCELLED]  # a sender that never ends its stream is not waited for

    asyncio.run(asyncio.wait_for(main(), timeout=10))


@pytest.mark.parametrize("group_size", [2, 3, 4])
@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_every_member_reduces_a_part_of_a_short_flat_buffer(group_size, codec):
    """hivemind's partitioner, on `tiny`'s flat gradient buffer (34,624 values: less than one part of
    its default size): with the default one member gets every part and another none; with the part
    size of `part_size_for_group`, every member reduces some."""
    flat = torch.zeros(34_624)
    compression = COMPRESSIONS[codec]()
    fractions = [1.0] * group_size
    default = TensorPartContainer([flat], fractions, compression=compression)
    assert 0 in default.num_parts_by_peer
    bytes_per_value = flat.element_size() * compression.estimate_compression_ratio(CompressionInfo.from_tensor(flat))
    part_size = part_size_for_group(flat.numel(), group_size, bytes_per_value, DEFAULT_PART_SIZE_BYTES)
    fitted = TensorPartContainer([flat], fractions, compression=compression, part_size_bytes=part_size)
    assert min(fitted.num_parts_by_peer) >= 1, fitted.num_parts_by_peer
    # a long buffer keeps hivemind's part size
    assert part_size_for_group(2_467_584, 2, 4.0, DEFAULT_PART_SIZE_BYTES) == DEFAULT_PART_SIZE_BYTES


def test_the_committed_step_ids_a_replica_remembers_are_bounded():
    from peers.replicas.averaging import RecentIds

    committed = RecentIds(3)
    for step_id in ("a", "b", "c", "d"):
        committed.add(step_id)
    assert "a" not in committed and all(s in committed for s in "bcd") and len(committed) == 3
    committed.add("b")  # seen again: the newest, forgotten last
    committed.add("e")
    assert "c" not in committed and "b" in committed
