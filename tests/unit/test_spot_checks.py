"""Spot checks (issues #25, #59): the pure decisions (swarm/trainer/spot_checks.py) and
StageCaller.verify against scripted replicas, one of which lies plausibly, on every kind of call: a
forward, the last stage's fused call, a backward. No network, no DHT."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from dht.records import PeerRecord, PeerState
from swarm.trainer.client import CallResult
from swarm.trainer.config import FailoverSettings
from swarm.trainer.data import Microbatch
from swarm.trainer.discovery import SwarmView
from swarm.trainer.routing import ReplicaInfo
from swarm.trainer.schedule import StepSchedule, backward_request
from swarm.trainer.spot_checks import (
    PRECISION_ERRORS,
    TIGHT,
    Answer,
    CallSampler,
    Dispute,
    calls_to_check,
    comparable_replicas,
    difference,
    judge,
    least_contradicted,
    recompute_is_stale,
    relative_difference,
    third_opinion,
    tolerance,
    unchecked_because,
)
from swarm.trainer.stage_call import Payload, StageCaller, check_answer
from wire.compression import RELATIVE_ERROR_BOUNDS, decode, encode
from wire.protocol import ResponseHeader
from wire.tensors import decode_tensors, encode_tensor

B, T, D = 2, 8, 16


def activations(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed)) * 3.0 + 0.5


# ---------------------------------------------------------------- pure decisions


def test_tolerance_is_tight_uncompressed_and_twice_the_codec_bound_otherwise():
    assert tolerance("none") == pytest.approx(1e-3)
    assert tolerance("fp16") == pytest.approx(1e-3 + 2e-3)
    assert tolerance("int8") == pytest.approx(1e-3 + 0.04)
    assert tolerance("topk") > 1.0  # top-k drops values: no plausible lie is caught under it


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_honest_answers_through_a_codec_agree_and_a_five_percent_lie_does_not(codec):
    """Two replicas' answers differ by float noise before encoding; a liar's by 5%."""
    honest = activations(1)
    other_machine = honest * (1 + 1e-6 * torch.randn(honest.shape, generator=torch.Generator().manual_seed(2)))
    through = [decode(encode(t, codec)) for t in (honest, other_machine, honest * 1.05)]
    assert relative_difference(decode(encode(honest, codec)), honest) <= RELATIVE_ERROR_BOUNDS[codec]
    assert relative_difference(through[0], through[1]) <= tolerance(codec)
    assert relative_difference(through[0], through[2]) > tolerance(codec)


def test_relative_difference_of_zeros_and_of_other_shapes():
    zeros = torch.zeros(3)
    assert relative_difference(zeros, zeros) == 0.0
    assert relative_difference(zeros, torch.ones(3)) == pytest.approx(1.0)
    assert relative_difference(zeros, torch.zeros(4)) == float("inf")


def test_the_sampler_picks_about_its_fraction_the_same_way_for_the_same_seed():
    sampler, again, other = CallSampler(0.2, seed=7), CallSampler(0.2, seed=7), CallSampler(0.2, seed=8)
    picks = [sampler.pick() for _ in range(2000)]
    assert picks == [again.pick() for _ in range(2000)] != [other.pick() for _ in range(2000)]
    assert 0.17 < sum(picks) / len(picks) < 0.23
    assert not any(CallSampler(0.0).pick() for _ in range(100))
    assert all(CallSampler(1.0).pick() for _ in range(100))
    with pytest.raises(ValueError):
        CallSampler(1.5)
    # each purpose draws its own picks from the same seed: the microbatches timed through the trainer
    # (--hub-timing-fraction) are not the calls spot-checked
    timing = CallSampler(0.2, seed=7, purpose="hub-timing")
    assert [timing.pick() for _ in range(2000)] != picks


def test_two_agreeing_answers_are_agreed_and_their_difference_kept():
    verdict = judge({"a": activations(), "b": activations() * (1 + 1e-4)}, tolerance("none"))
    assert verdict.agreed and verdict.decided and verdict.minority == () and verdict.trusted == "a"
    assert verdict.largest_agreeing_difference == pytest.approx(1e-4 / (1 + 1e-4), rel=1e-3)


def test_two_answers_that_differ_decide_nothing():
    verdict = judge({"a": activations() * 1.05, "b": activations()}, tolerance("none"))
    assert not verdict.agreed and not verdict.decided and verdict.minority == () and verdict.trusted == "a"


@pytest.mark.parametrize("liar", ["a", "b", "c"])
def test_the_one_of_three_that_agrees_with_neither_other_is_the_minority(liar):
    answers = {p: activations() * (1.05 if p == liar else 1.0) for p in "abc"}
    verdict = judge(answers, tolerance("none"))
    assert verdict.minority == (liar,) and verdict.decided and verdict.largest_agreeing_difference == 0.0
    assert verdict.trusted == ("a" if liar != "a" else "b")  # the pipeline's own answer, unless it lied


def test_three_answers_apart_or_in_a_chain_decide_nothing():
    base = activations()
    apart = judge({"a": base, "b": base * 1.05, "c": base * 1.1}, 0.01)
    chain = judge({"a": base, "b": base * 1.03, "c": base * 1.06}, 0.04)  # a~b, b~c, not a~c
    for verdict in (apart, chain):
        assert not verdict.decided and verdict.trusted == "a"


# ---------------------------------------------------------------- StageCaller.verify, scripted replicas


class ScriptedReplicas:
    """Every replica computes what the same weights would: a forward 2 * inputs + 1; a backward of
    the last stage (it gets targets) the input gradient inputs / 2, the loss 3 + mean(inputs) and a
    gradient sample of the inputs' first 16 values / 10; a backward of stage 0 (it gets grad_outputs)
    no input gradient and the sample of (inputs * grad_outputs). The `liars` answer all of it times
    1.05, the `noisy` with relative noise `noise` (another machine's rounding); `failing` raise.
    `steps`: the optimizer steps a replica's parameters have taken (default 0), which it states in its
    answers; each step adds 0.25 to its forward's outputs, as a step moves the weights."""

    def __init__(self, liars=(), failing=(), noisy=(), noise=0.0, steps=None):
        self.liars, self.failing, self.noisy, self.noise, self.calls = set(liars), set(failing), set(noisy), noise, []
        self.steps: dict[str, int] = dict(steps or {})
        self._generator = torch.Generator().manual_seed(5)
        self.cached: dict[tuple[str, str], torch.Tensor] = {}  # (replica, microbatch) -> its forward's inputs

    def _told(self, peer_id, value: torch.Tensor) -> torch.Tensor:
        if peer_id in self.liars:
            return value * 1.05
        if peer_id in self.noisy:
            jitter = torch.randn(value.shape, generator=self._generator, dtype=value.dtype)
            return value + jitter * (self.noise * value.norm() / jitter.norm())
        return value

    async def exchange(self, peer_id, *, rpc, stage, microbatch_id, batch_size, tensors, response_codec, **kw):
        from swarm.trainer.client import PeerCallError
        from wire.failures import Failure

        self.calls.append(
            {"peer": peer_id, "rpc": rpc, "stage": stage, "tensors": dict(tensors), "codec": response_codec.codec, **kw}
        )
        if peer_id in self.failing:
            raise PeerCallError(peer_id, Failure.TRANSPORT, "stream reset")
        given = decode_tensors(dict(tensors))
        if kw.get("inputs_cached"):  # a backward on the replica that served the forward (not a recompute)
            if (peer_id, microbatch_id) not in self.cached:
                raise PeerCallError(peer_id, Failure.CACHE_MISS, "no cached forward")
            given["inputs"] = self.cached[(peer_id, microbatch_id)]
        inputs = given["inputs"]
        if rpc == "forward" and not kw.get("check_precision"):
            self.cached[(peer_id, microbatch_id)] = inputs
        steps = self.steps.get(peer_id, 0)
        if rpc == "forward":
            outputs = {"outputs": self._told(peer_id, 2 * inputs + 1 + 0.25 * steps)}
            header = ResponseHeader(compute_s=0.01, steps_done=steps)
        elif "targets" in given:
            outputs = {"grad_inputs": self._told(peer_id, inputs / 2)}
            loss = float(self._told(peer_id, torch.tensor(3.0 + float(inputs.mean()), dtype=torch.float64)))
            sample = self._told(peer_id, inputs.flatten()[:16].double() / 10).tolist()
            header = ResponseHeader(loss=loss, grad_sample=sample, compute_s=0.01)
        else:
            outputs = {}
            sample = self._told(peer_id, (inputs * given["grad_outputs"]).flatten()[:16].double()).tolist()
            header = ResponseHeader(grad_sample=sample, compute_s=0.01)
        encoded = {n: encode_tensor(t, response_codec.codec, response_codec.params) for n, t in outputs.items()}
        return CallResult(decode_tensors(encoded), encoded, header, 100)


def serve(
    view: SwarmView, stage: int, peers, averaging: str = "sync", precision: str = "", weight_prediction: str = ""
) -> None:
    """`peers` serve `stage` (their records, and the stage's scheduler)."""
    view.records[stage] = [
        PeerRecord(
            peer_id=p,
            model="tiny",
            stage=stage,
            num_stages=view.num_stages,
            state=PeerState.ONLINE,
            throughput=10.0,
            expires_at=1e12,
            averaging=averaging,
            precision=precision,
            weight_prediction=weight_prediction,
        )
        for p in peers
    ]
    view.schedulers[stage].update_replicas([ReplicaInfo(p, 10.0) for p in peers])


def make_caller(
    client, peers, verify_fraction=1.0, averaging="sync", precision="", weight_prediction=""
) -> StageCaller:
    view = SwarmView(None, model="tiny", num_stages=2)
    caller = StageCaller(
        view,
        client,
        d_model=D,
        seq_len=T,
        failover=FailoverSettings(max_retries=2, stage_wait_timeout_s=1.0),
        verify_fraction=verify_fraction,
    )
    for stage in range(2):
        serve(view, stage, peers, averaging, precision, weight_prediction)
    return caller


def forward_then_verify(caller: StageCaller, *, order: tuple[str, ...] = ()):
    """A forward on stage 0, then its spot check; replicas are asked in `order` when given (the later
    ones made to look busier)."""
    scheduler = caller.view.schedulers[0]
    for rank, peer_id in enumerate(order):
        if rank:
            scheduler.choose("forward", 1000 * rank, exclude=set(scheduler.keys_s()) - {peer_id})
    tensors = [("inputs", Payload(activations()))]

    async def run():
        answer = await caller.call(0, "forward", "mb", B, tensors)
        return answer, await caller.verify(0, "mb", B, answer)

    return asyncio.run(run())


def test_agreeing_replicas_are_verified_with_one_extra_call_of_the_same_request():
    client = ScriptedReplicas()
    caller = make_caller(client, ["peer-a", "peer-b", "peer-c"])
    answer, kept = forward_then_verify(caller)
    assert kept is answer and len(client.calls) == 2 and client.calls[0]["peer"] != client.calls[1]["peer"]
    assert client.calls[1]["tensors"]["inputs"] is client.calls[0]["tensors"]["inputs"]  # resent as sent
    counters = caller.counters
    assert (counters.calls_verified, counters.verify_mismatches, counters.verify_calls) == (1, 0, 1)
    assert counters.banned_peers == {}


@pytest.mark.parametrize("liar_first", [True, False])
def test_a_plausible_liar_among_three_is_banned_for_the_run_and_its_answer_dropped(liar_first):
    client = ScriptedReplicas(liars={"peer-liar"})
    caller = make_caller(client, ["peer-a", "peer-b", "peer-liar"])
    honest = 2 * activations() + 1
    # The liar answers the pipeline's call, or it is the second replica asked: the third decides.
    order = ("peer-liar", "peer-a", "peer-b") if liar_first else ("peer-a", "peer-liar", "peer-b")
    answer, kept = forward_then_verify(caller, order=order)
    assert [c["peer"] for c in client.calls] == list(order)
    assert kept.peer_id != "peer-liar" and torch.allclose(kept.outputs["outputs"], honest)
    assert list(caller.counters.banned_peers) == ["peer-liar"]
    assert "differed" in caller.counters.banned_peers["peer-liar"]
    assert (caller.counters.calls_verified, caller.counters.verify_mismatches, caller.counters.verify_calls) == (
        1,
        1,
        2,
    )
    assert "peer-liar" in caller.view.violations.banned(0) and "peer-liar" in caller.view.violations.banned(1)
    registry = caller.metrics.registry
    for name in ("calls_verified", "verify_mismatches", "verify_bans"):
        assert registry.get_sample_value(f"swarm_trainer_{name}_total", {"stage": "0"}) == 1, name
    # Caught again by a check that was in flight: banned and counted once.
    caller.view.violations = type(caller.view.violations)()
    forward_then_verify(caller, order=("peer-liar", "peer-a", "peer-b"))
    assert list(caller.counters.banned_peers) == ["peer-liar"] and caller.counters.verify_mismatches == 2
    assert registry.get_sample_value("swarm_trainer_verify_bans_total", {"stage": "0"}) == 1
    # Banned for the run: no later call or check goes there.
    caller.view.violations.lied("peer-liar", "again")
    client.calls.clear()
    forward_then_verify(caller)
    assert {c["peer"] for c in client.calls} == {"peer-a", "peer-b"}


def test_two_replicas_that_disagree_ban_nobody_and_a_lone_one_is_not_verified():
    client = ScriptedReplicas(liars={"peer-liar"})
    caller = make_caller(client, ["peer-a", "peer-liar"])
    answer, kept = forward_then_verify(caller, order=("peer-a", "peer-liar"))
    assert kept is answer and caller.counters.verify_mismatches == 1 and caller.counters.banned_peers == {}
    alone = make_caller(ScriptedReplicas(), ["peer-a"])
    answer, kept = forward_then_verify(alone)
    assert kept is answer and alone.counters.calls_verified == 0 and alone.counters.verify_calls == 0


@pytest.mark.parametrize(("averaging", "prediction"), [("periodic", ""), ("none", ""), ("sync", "local-step")])
def test_replicas_whose_answers_may_differ_are_not_compared(averaging, prediction):
    """Replicas that do not average in sync hold other parameters (between rounds, or always), and
    replicas predicting their next parameters from their own gradients compute on different ones: a
    check would ban an honest replica."""
    client = ScriptedReplicas(liars={"peer-liar"})
    caller = make_caller(client, ["peer-a", "peer-liar"], averaging=averaging, weight_prediction=prediction)
    answer, kept = forward_then_verify(caller, order=("peer-a", "peer-liar"))
    assert kept is answer and len(client.calls) == 1 and caller.counters.calls_verified == 0


def test_a_replica_predicting_from_its_own_gradients_is_named_once_as_never_checked(caplog):
    client = ScriptedReplicas(liars=set())
    caller = make_caller(client, ["peer-a", "peer-b"], weight_prediction="local-step")
    with caplog.at_level(logging.WARNING):
        forward_then_verify(caller, order=("peer-a", "peer-b"))
        forward_then_verify(caller, order=("peer-a", "peer-b"))
    told = [r.getMessage() for r in caplog.records if "not spot-checked" in r.getMessage()]
    assert len(told) == 1 and "local-step" in told[0], told


def test_comparable_replicas_are_sync_replicas_on_their_parameters_in_any_precision():
    averaging = {"a": "sync", "b": "sync", "c": "sync", "d": "sync", "e": "sync", "f": "sync"}
    records = {  # '': an older peer's record (float32, no prediction)
        "a": ("fp32", "last-update"),
        "b": ("", ""),
        "c": ("bf16", ""),
        "d": ("fp16", ""),
        "e": ("fp32", "local-step"),
        "f": ("fp32", "none"),
    }
    unchecked = {peer: unchecked_because(*record) for peer, record in records.items()}
    assert comparable_replicas("a", averaging, unchecked=unchecked) == {"b", "c", "d", "f"}
    assert comparable_replicas("c", averaging, unchecked=unchecked) == {"a", "b", "d", "f"}
    assert comparable_replicas("e", averaging, unchecked=unchecked) == set()
    assert unchecked["c"] is None and "local-step" in unchecked["e"]


def test_comparable_replicas_average_in_sync_in_the_same_group():
    averaging = {"a": "sync", "b": "sync", "c": "periodic", "d": "sync"}
    assert comparable_replicas("a", averaging) == {"b", "d"}
    assert comparable_replicas("c", averaging) == set()
    assert comparable_replicas("a", averaging, members={"a", "b", "c"}) == {"b"}
    assert comparable_replicas("d", averaging, members={"a", "b"}) == set()  # outside the run: averages alone


def test_a_failing_second_replica_leaves_the_call_unverified():
    client = ScriptedReplicas(failing={"peer-b"})
    caller = make_caller(client, ["peer-a", "peer-b"])
    answer, kept = forward_then_verify(caller, order=("peer-a", "peer-b"))
    assert kept is answer and caller.counters.calls_verified == 0 and caller.counters.verify_calls == 1
    assert "peer-b" in caller.view.bans.banned()


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_the_check_asks_for_the_first_answers_codec_and_judges_with_its_tolerance(codec):
    from wire.compression.policy import CodecPolicy

    client = ScriptedReplicas(liars={"peer-liar"})
    caller = make_caller(client, ["peer-a", "peer-b", "peer-liar"])
    caller.codecs = CodecPolicy(codec)
    forward_then_verify(caller, order=("peer-a", "peer-liar", "peer-b"))
    assert {c["codec"] for c in client.calls} == {codec}
    assert caller.counters.verify_mismatches == 1 and list(caller.counters.banned_peers) == ["peer-liar"]


def two_stage_schedule(client, first: tuple[str, ...], last: tuple[str, ...], verify_fraction=1.0):
    view = SwarmView(None, model="tiny", num_stages=2)
    caller = StageCaller(
        view,
        client,
        d_model=D,
        seq_len=T,
        failover=FailoverSettings(max_retries=2, stage_wait_timeout_s=1.0),
        verify_fraction=verify_fraction,
    )
    serve(view, 0, first)
    serve(view, 1, last)
    return caller, StepSchedule(caller, max_in_flight=1, run_id="run", routing="hub")


def run_microbatches(schedule: StepSchedule, count: int) -> list[float]:
    microbatches = [
        Microbatch(step=0, index=i, inputs=activations(i), targets=torch.zeros(B, T, dtype=torch.long))
        for i in range(count)
    ]

    async def run():
        return [await schedule.run_microbatch(mb) for mb in microbatches]

    return asyncio.run(run())


def test_the_schedule_checks_a_forward_and_goes_on_with_the_majority():
    """Two stages, every call checked: the liar of stage 0 is banned (on whichever call it served
    first), and its answer never reaches stage 1."""
    client = ScriptedReplicas(liars={"peer-liar"})
    caller, schedule = two_stage_schedule(client, ("peer-a", "peer-b", "peer-liar"), ("peer-last",))
    losses = run_microbatches(schedule, 4)
    assert list(caller.counters.banned_peers) == ["peer-liar"]
    sent_on = [decode_tensors(dict(c["tensors"]))["inputs"] for c in client.calls if c["stage"] == 1]
    assert sent_on and all(any(torch.allclose(x, 2 * activations(i) + 1) for i in range(4)) for x in sent_on)
    assert losses == [pytest.approx(3.0 + float((2 * activations(i) + 1).mean())) for i in range(4)]


def test_the_last_stages_fused_call_is_checked_on_its_loss_gradient_and_sample_and_its_liar_banned():
    """The last stage's replicas: one scales its loss, input gradient and gradient sample. A check
    recomputes the call on another replica (a float32 recompute: nothing kept there), a third
    settles it; the honest gradient goes back to stage 0."""
    client = ScriptedReplicas(liars={"peer-liar"})
    caller, schedule = two_stage_schedule(client, ("peer-first",), ("peer-a", "peer-b", "peer-liar"))
    run_microbatches(schedule, 6)
    counters = caller.counters
    assert list(counters.banned_peers) == ["peer-liar"], counters.banned_peers
    assert "last stage's" in counters.banned_peers["peer-liar"]
    assert counters.calls_verified_by_call.get("last", 0) >= 1
    checks = [c for c in client.calls if c.get("check_precision")]
    assert checks and all(c["check_precision"] == "fp32" and c["grad_sample"] for c in checks)
    assert all(c["stage"] == 1 and "targets" in c["tensors"] for c in checks)
    # every backward of the run asks for its gradient sample (the checked one cannot be told apart)
    assert all(c["grad_sample"] for c in client.calls if c["rpc"] == "backward" and not c.get("check_precision"))
    # what stage 0's backward was sent is always an honest gradient
    for call in client.calls:
        if call["stage"] == 0 and call["rpc"] == "backward" and not call.get("check_precision"):
            grad = decode_tensors({"g": call["tensors"]["grad_outputs"]})["g"]
            assert any(torch.allclose(grad, (2 * activations(i) + 1) / 2) for i in range(6))
    ledger = caller.contributions
    assert ledger.get("peer-liar").mismatches >= 1 and ledger.get("peer-liar").samples_verified == 0
    assert ledger.get("peer-a").samples_verified + ledger.get("peer-b").samples_verified >= B


def test_a_backward_of_the_first_stage_is_checked_on_its_gradient_sample():
    """Stage 0's backward answers no input gradient (its inputs are token ids); its check compares the
    sample of the parameter gradient it computed, recomputed from its inputs (cached on the replica:
    the forward's, as sent) and the gradient it was sent."""
    client = ScriptedReplicas(liars={"peer-liar"})
    caller, schedule = two_stage_schedule(client, ("peer-a", "peer-b", "peer-liar"), ("peer-last",))
    caller.spot_checks = CallSampler(1.0)
    run_microbatches(schedule, 6)
    assert list(caller.counters.banned_peers) == ["peer-liar"]
    rechecked = [c for c in client.calls if c.get("check_precision") and c["rpc"] == "backward" and c["stage"] == 0]
    assert rechecked and all({"inputs", "grad_outputs"} <= set(c["tensors"]) for c in rechecked)
    assert caller.counters.calls_verified_by_call.get("backward", 0) >= 1


def test_a_backward_served_from_the_cache_is_rechecked_with_the_inputs_its_forward_was_sent():
    forward = (("inputs", encode_tensor(activations(1))), ("tokens", encode_tensor(torch.zeros(2, 3))))
    cached = (("grad_outputs", encode_tensor(activations(2))),)
    assert [n for n, _ in backward_request(cached, forward)] == ["inputs", "tokens", "grad_outputs"]
    sent = (("inputs", encode_tensor(activations(3))), ("grad_outputs", cached[0][1]))
    assert backward_request(sent, forward)[1:] == sent and backward_request(sent, forward)[0][0] == "tokens"


def test_an_answer_announced_in_bf16_is_held_to_the_bf16_bound_against_a_float32_recompute():
    """An honest bf16 replica's answer differs from the float32 recompute by its rounding (here 0.5%:
    passes); a replica announcing bf16 that lies by 3% is caught all the same."""
    for noise, caught in ((0.005, False), (0.03, True)):
        client = ScriptedReplicas(noisy={"peer-bf16"}, noise=noise)
        caller = make_caller(client, ["peer-bf16", "peer-a", "peer-b"], precision="bf16")
        answer, kept = forward_then_verify(caller, order=("peer-bf16", "peer-a", "peer-b"))
        assert (list(caller.counters.banned_peers) == ["peer-bf16"]) is caught, (noise, caller.counters.banned_peers)
    # announced float32, the same 0.5% is a lie
    client = ScriptedReplicas(noisy={"peer-c"}, noise=0.005)
    caller = make_caller(client, ["peer-c", "peer-a", "peer-b"])
    forward_then_verify(caller, order=("peer-c", "peer-a", "peer-b"))
    assert list(caller.counters.banned_peers) == ["peer-c"]


def test_the_ledger_counts_each_replicas_samples_checks_mismatches_and_ban():
    client = ScriptedReplicas(liars={"peer-liar"}, failing={"peer-down"})
    caller = make_caller(client, ["peer-a", "peer-b", "peer-liar", "peer-down"])
    caller.view.schedulers[0].update_replicas([ReplicaInfo(p, 10.0) for p in ("peer-a", "peer-b", "peer-liar")])
    forward_then_verify(caller, order=("peer-a", "peer-b"))  # agreed
    forward_then_verify(caller, order=("peer-liar", "peer-a", "peer-b"))  # the liar answers: caught
    ledger = caller.contributions
    liar, a, b = ledger.get("peer-liar"), ledger.get("peer-a"), ledger.get("peer-b")
    assert (liar.samples_served, liar.calls_answered, liar.calls_verified, liar.mismatches) == (0, 1, 1, 1)
    assert "differed" in liar.banned and liar.banned == caller.counters.banned_peers["peer-liar"]
    for honest in (a, b):  # in both checks, on the majority's side in the second
        assert (honest.calls_verified, honest.mismatches, honest.banned) == (2, 0, None)
        assert honest.calls_answered == 2 and honest.samples_served == 0  # forwards: no samples served
    caller.view.schedulers[0].update_replicas([ReplicaInfo(p, 10.0) for p in ("peer-down", "peer-a")])
    caller.view.bans.clear("peer-a")
    forward_then_verify(caller, order=("peer-down", "peer-a"))  # fails over to peer-a; nobody to check with
    assert ledger.get("peer-down").calls_failed == 1 and ledger.get("peer-down").calls_answered == 0
    assert ledger.get("peer-a").calls_answered == 3


def test_two_replicas_that_disagree_are_a_dispute_held_for_a_third_and_reported_if_none_comes():
    caller = make_caller(ScriptedReplicas(liars={"peer-liar"}), ["peer-a", "peer-liar"])
    forward_then_verify(caller, order=("peer-a", "peer-liar"))
    assert caller.counters.verify_disputes == 1 and caller.counters.banned_peers == {} and len(caller.held) == 1
    asyncio.run(caller.settle_disputes(0))  # the step ends, no third replica: unresolved, reported
    assert caller.counters.verify_disputes_unresolved == 1 and not caller.held
    (dispute,) = caller.disputes_unresolved
    assert dispute.peers == ("peer-a", "peer-liar") and dispute.call == "forward" and dispute.share > 1
    for peer in ("peer-a", "peer-liar"):
        entry = caller.contributions.get(peer)
        assert (entry.calls_verified, entry.mismatches, entry.disputes, entry.banned) == (1, 1, 1, None)


def test_a_held_dispute_is_settled_by_a_replica_that_joins_before_the_step_ends():
    client = ScriptedReplicas(liars={"peer-liar"})
    caller = make_caller(client, ["peer-a", "peer-liar"])
    forward_then_verify(caller, order=("peer-liar", "peer-a"))
    assert caller.counters.banned_peers == {} and len(caller.held) == 1
    serve(caller.view, 0, ["peer-a", "peer-liar", "peer-new"])  # a third replica joins the stage
    asyncio.run(caller.settle_disputes(0))
    assert list(caller.counters.banned_peers) == ["peer-liar"]
    assert caller.counters.verify_disputes_settled == 1 and caller.counters.verify_third_opinions == 1
    assert client.calls[-1]["peer"] == "peer-new" and client.calls[-1]["check_precision"] == "fp32"
    assert caller.contributions.get("peer-a").samples_verified == 0  # a's answer was the checker's, not its call


def test_the_schedule_settles_its_steps_disputes_before_committing(monkeypatch):
    """run_step commits; a dispute of the step is settled (or reported) before the replicas step."""
    client = ScriptedReplicas(liars={"peer-liar"})
    caller, schedule = two_stage_schedule(client, ("peer-a", "peer-liar"), ("peer-last",))
    held_at_commit = []

    async def commit(step_id, groups, *args, **kwargs):  # no replica to commit to in this test
        held_at_commit.append(len(caller.held))
        return {}

    monkeypatch.setattr(schedule, "_commit", commit)
    microbatches = [
        Microbatch(step=3, index=i, inputs=activations(i), targets=torch.zeros(B, T, dtype=torch.long))
        for i in range(2)
    ]
    asyncio.run(schedule.run_step(microbatches))
    assert caller.counters.verify_disputes >= 1 and held_at_commit == [0]  # settled before the commit
    assert caller.counters.verify_disputes_unresolved == caller.counters.verify_disputes  # nobody to ask
    assert all(d.step == 3 for d in caller.disputes_unresolved) and caller.counters.banned_peers == {}


# ---------------------------------------------------------------- pure decisions of issue #59


def test_the_tolerance_adds_each_answers_precision_error_and_the_codec_only_for_coded_tensors():
    assert tolerance("none", ("bf16", "fp32")) == pytest.approx(TIGHT + PRECISION_ERRORS["bf16"])
    assert tolerance("none", ("bf16", "bf16")) == pytest.approx(TIGHT + 2 * PRECISION_ERRORS["bf16"])
    assert tolerance("int8", ("fp32", "fp32"), coded=False) == pytest.approx(TIGHT)
    assert tolerance("none", ("tf32", "fp32")) == pytest.approx(TIGHT)  # an unknown precision buys nothing
    assert 0.0 < PRECISION_ERRORS["fp16"] < PRECISION_ERRORS["bf16"] < 0.03  # a 3% lie exceeds every bound


def test_two_answers_agree_when_every_component_is_within_its_tolerance():
    honest = {"grad_inputs": activations(1), "loss": torch.tensor(4.0), "grad_sample": activations(2).flatten()}
    same = Answer({k: v * (1 + 2e-4) for k, v in honest.items()})
    loss_lie = Answer({**honest, "loss": torch.tensor(4.0 * 1.05)})
    no_sample = Answer({k: v for k, v in honest.items() if k != "grad_sample"})
    share, raw = difference(Answer(honest), same, "none")
    assert share < 1.0 and raw == pytest.approx(2e-4, rel=1e-2)
    assert difference(Answer(honest), loss_lie, "none")[0] > 1.0  # one component off is a disagreement
    assert difference(Answer(honest), no_sample, "none")[0] == float("inf")  # a missing component too
    # the loss and the sample travel as floats: int8's bound does not widen them
    assert difference(Answer(honest), Answer({**honest, "loss": torch.tensor(4.0 * 1.01)}), "int8")[0] > 1.0
    bf16 = Answer({k: v * 1.008 for k, v in honest.items()}, precision="bf16")
    assert (
        difference(bf16, Answer(honest), "none")[0]
        < 1.0
        < difference(Answer(bf16.components), Answer(honest), "none")[0]
    )
    verdict = judge({"a": Answer(honest), "b": same, "c": loss_lie}, "none")
    assert verdict.minority == ("c",) and 0 < verdict.largest_agreeing_share < 1


def test_a_majority_of_two_or_more_bans_every_answer_it_disagrees_with_and_a_tie_bans_nobody():
    base = activations()
    several = {"h1": base, "l1": base * 1.05, "h2": base * (1 + 1e-4), "l2": base * 0.9, "l3": base * 1.2}
    verdict = judge(several, tolerance("none"))
    assert set(verdict.minority) == {"l1", "l2", "l3"} and verdict.trusted == "h1"
    colluding = {"h1": base, "c1": base * 1.05, "h2": base, "c2": base * 1.05}  # two against two
    assert not judge(colluding, tolerance("none")).decided
    first_lies = {"l1": base * 1.05, "h1": base, "l2": base * 0.9, "h2": base}
    assert judge(first_lies, tolerance("none")).trusted == "h1"
    with pytest.raises(ValueError):
        judge({p: base for p in "abcdef"}, tolerance("none"))


def test_a_check_asks_on_until_a_majority_shows():
    """Among two honest replicas and three liars (each its own lie), the liars' answers agree with
    nothing: the check asks on until two agree, and bans every liar it asked."""
    client = ScriptedReplicas(liars={"l1"})
    client.liars = set()
    factors = {"l1": 1.05, "l2": 0.9, "l3": 1.2}
    original = client._told
    client._told = lambda peer, value: value * factors[peer] if peer in factors else original(peer, value)
    caller = make_caller(client, ["l1", "l2", "l3", "h1", "h2"])
    forward_then_verify(caller, order=("l1", "l2", "l3", "h1", "h2"))
    assert set(caller.counters.banned_peers) == {"l1", "l2", "l3"}
    assert caller.counters.verify_third_opinions == 3 and caller.counters.verify_calls == 4


def test_a_check_whose_five_opinions_show_no_majority_bans_nobody_and_counts_undecided():
    """One honest answer and four liars' (each its own lie), a second honest replica left unasked:
    five opinions and no two agree, so nobody is banned and each of the five counts a mismatch."""
    client = ScriptedReplicas()
    factors = {"l1": 1.05, "l2": 0.9, "l3": 1.2, "l4": 0.8}
    original = client._told
    client._told = lambda peer, value: value * factors[peer] if peer in factors else original(peer, value)
    caller = make_caller(client, ["h1", "l1", "l2", "l3", "l4", "h2"])
    forward_then_verify(caller, order=("h1", "l1", "l2", "l3", "l4", "h2"))
    assert caller.counters.banned_peers == {} and caller.counters.verify_undecided == 1
    ledger = caller.contributions.snapshot()
    assert [ledger[p]["mismatches"] for p in ("h1", "l1", "l2", "l3", "l4")] == [1] * 5
    assert "h2" not in ledger or ledger["h2"]["calls_verified"] == 0
    # the next check asks the replica checks have contradicted least: h2, with h1 a majority
    forward_then_verify(caller, order=("l1", "l2", "l3", "l4", "h1", "h2"))
    assert set(caller.counters.banned_peers) >= {"l1"} and not {"h1", "h2"} & set(caller.counters.banned_peers)


def test_a_further_opinion_comes_from_the_replicas_contradicted_least():
    records = {"liar": (4, 4), "honest": (1, 5), "unlucky": (1, 1)}
    assert least_contradicted(["liar", "honest", "unlucky", "new"], records) == {"new"}
    assert least_contradicted(["liar", "honest", "unlucky"], records) == {"honest"}
    assert least_contradicted(["liar", "unlucky"], records) == {"liar", "unlucky"}
    assert least_contradicted([], records) == set()


def test_every_call_of_a_microbatch_can_be_checked_in_the_pipelines_order():
    assert calls_to_check(2) == [(0, "forward"), (1, "backward"), (0, "backward")]
    assert calls_to_check(3) == [(0, "forward"), (1, "forward"), (2, "backward"), (1, "backward"), (0, "backward")]


def test_a_third_opinion_comes_from_another_comparable_replica_of_the_same_step():
    dispute = Dispute(stage=1, call="backward", microbatch_id="m", peers=("a", "b"), share=3.0, step=7)
    assert third_opinion(dispute, {"a", "b", "c", "d"}, excluded={"c"}, step=7) == "d"
    assert third_opinion(dispute, {"a", "b"}, excluded=set(), step=7) is None  # nobody else
    assert third_opinion(dispute, {"a", "b", "c"}, excluded=set(), step=8) is None  # the parameters moved on


def test_an_answer_that_owes_a_gradient_sample_must_carry_a_finite_one():
    from swarm.trainer.client import PeerCallError

    kwargs = dict(num_stages=2, expected_shape=(B, T, D), outputs={}, loss=None)
    check_answer("p", 0, "backward", grad_sample=[0.1, 0.2], **kwargs)
    check_answer("p", 0, "backward", **kwargs)  # none asked
    for bad in (None, [], [float("nan")], [0.0] * 129):
        with pytest.raises(PeerCallError, match="gradient sample"):
            check_answer("p", 0, "backward", grad_sample=bad, **kwargs)


# ---------------------------------------------------------------- several trainers: answers of another step


def test_a_recompute_is_stale_only_where_another_trainer_may_have_stepped_the_replicas_since():
    assert recompute_is_stale(3, 4, steps_may_move=True)
    assert not recompute_is_stale(3, 4, steps_may_move=False)  # one trainer: its commits wait for its checks
    assert not recompute_is_stale(4, 4, steps_may_move=True)  # the same step: compared
    assert not recompute_is_stale(5, 4, steps_may_move=True)  # the checker lags: compared, a third settles it
    assert not recompute_is_stale(3, 4, steps_may_move=True, floor=4)  # below what it answered our commit with
    assert recompute_is_stale(4, 5, steps_may_move=True, floor=4)
    assert not recompute_is_stale(None, 4, steps_may_move=True) and not recompute_is_stale(3, None, steps_may_move=True)


def test_a_recompute_after_another_trainers_commit_is_not_compared_and_bans_nobody():
    """Three honest replicas: the checked one answered at step 0; by the recompute the run's other
    trainer has committed, and the others are at step 1 (their answers differ by the step). With
    several trainers, nothing is compared and nothing counted against anyone; with one, the same
    difference is a mismatch (a lagging replica's answer is wrong there), settled by the majority."""
    for several, stale, banned in ((True, 1, []), (False, 0, ["peer-a"])):
        client = ScriptedReplicas(steps={"peer-a": 0, "peer-b": 1, "peer-c": 1})
        caller = make_caller(client, ["peer-a", "peer-b", "peer-c"])
        caller.steps_may_move = several
        answer, kept = forward_then_verify(caller, order=("peer-a", "peer-b", "peer-c"))
        counters = caller.counters
        assert (counters.verify_stale, list(counters.banned_peers)) == (stale, banned), counters
        assert (counters.verify_mismatches, counters.verify_disputes) == ((0, 0) if several else (1, 0))
        assert (kept is answer) is several
        assert caller.contributions.get("peer-a").mismatches == (0 if several else 1)


def test_an_answer_claiming_fewer_steps_than_its_replica_answered_our_commit_with_is_judged():
    """A liar that says it computed before the last commit, to have its checks skipped as stale: our
    own commit saw it at step 1, so a later answer of step 0 excuses nothing."""
    client = ScriptedReplicas(steps={"peer-a": 0, "peer-b": 1, "peer-c": 1})
    caller = make_caller(client, ["peer-a", "peer-b", "peer-c"])
    caller.steps_may_move = True
    caller.steps_committed[(0, "peer-a")] = 1
    forward_then_verify(caller, order=("peer-a", "peer-b", "peer-c"))
    assert caller.counters.verify_stale == 0 and list(caller.counters.banned_peers) == ["peer-a"]


def test_a_dispute_is_not_settled_by_a_replica_that_stepped_since():
    """Two replicas of step 0 disagree (one lies); the third, asked later, is at step 1 after another
    trainer's commit: it cannot tell, so the dispute stays unresolved and nobody is banned."""
    client = ScriptedReplicas(liars={"peer-liar"}, steps={"peer-a": 0, "peer-liar": 0, "peer-late": 1})
    caller = make_caller(client, ["peer-a", "peer-liar"])
    caller.steps_may_move = True
    forward_then_verify(caller, order=("peer-liar", "peer-a"))
    assert caller.counters.verify_disputes == 1
    serve(caller.view, 0, ["peer-a", "peer-liar", "peer-late"])
    asyncio.run(caller.settle_disputes(0))
    counters = caller.counters
    assert (counters.verify_stale, counters.verify_disputes_unresolved, counters.banned_peers) == (1, 1, {})
