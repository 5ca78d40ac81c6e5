"""Spot checks (issue #25): the pure decisions (swarm/trainer/spot_checks.py) and StageCaller.verify
against scripted replicas, one of which lies plausibly. No network, no DHT."""

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
from swarm.trainer.schedule import StepSchedule
from swarm.trainer.spot_checks import (
    CallSampler,
    comparable_replicas,
    judge,
    relative_difference,
    tolerance,
    unchecked_because,
)
from swarm.trainer.stage_call import Payload, StageCaller
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
    """Stage 0 of 2: every replica answers a forward with 2 * inputs + 1 (as the same weights would),
    the `liars` with that times 1.05; `failing` replicas raise."""

    def __init__(self, liars=(), failing=()):
        self.liars, self.failing, self.calls = set(liars), set(failing), []

    async def exchange(self, peer_id, *, rpc, stage, microbatch_id, batch_size, tensors, response_codec, **_):
        from swarm.trainer.client import PeerCallError
        from wire.failures import Failure

        self.calls.append({"peer": peer_id, "rpc": rpc, "tensors": dict(tensors), "codec": response_codec.codec})
        if peer_id in self.failing:
            raise PeerCallError(peer_id, Failure.TRANSPORT, "stream reset")
        inputs = decode_tensors(dict(tensors))["inputs"]
        outputs = (2 * inputs + 1) * (1.05 if peer_id in self.liars else 1.0)
        encoded = encode_tensor(outputs, response_codec.codec, response_codec.params)
        decoded = decode_tensors({"outputs": encoded})
        return CallResult(decoded, {"outputs": encoded}, ResponseHeader(compute_s=0.01), 100)


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


@pytest.mark.parametrize(
    ("averaging", "precision", "prediction"),
    [("periodic", "", ""), ("none", "", ""), ("sync", "bf16", ""), ("sync", "fp16", ""), ("sync", "", "local-step")],
)
def test_replicas_whose_answers_may_differ_are_not_compared(averaging, precision, prediction):
    """Replicas that do not average in sync hold other parameters (between rounds, or always),
    autocast answers differ beyond the float32 tolerance, and replicas predicting their next
    parameters from their own gradients compute on different ones: a check would ban an honest
    replica."""
    client = ScriptedReplicas(liars={"peer-liar"})
    caller = make_caller(
        client, ["peer-a", "peer-liar"], averaging=averaging, precision=precision, weight_prediction=prediction
    )
    answer, kept = forward_then_verify(caller, order=("peer-a", "peer-liar"))
    assert kept is answer and len(client.calls) == 1 and caller.counters.calls_verified == 0


def test_a_replica_in_half_precision_is_named_once_as_never_checked(caplog):
    client = ScriptedReplicas(liars=set())
    caller = make_caller(client, ["peer-a", "peer-b"], precision="bf16")
    with caplog.at_level(logging.WARNING):
        forward_then_verify(caller, order=("peer-a", "peer-b"))
        forward_then_verify(caller, order=("peer-a", "peer-b"))
    told = [r.getMessage() for r in caplog.records if "not spot-checked" in r.getMessage()]
    assert len(told) == 1 and "computes in bf16" in told[0], told


def test_comparable_replicas_compute_in_float32_on_their_parameters():
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
    assert comparable_replicas("a", averaging, unchecked=unchecked) == {"b", "f"}
    assert comparable_replicas("b", averaging, unchecked=unchecked) == {"a", "f"}
    assert comparable_replicas("c", averaging, unchecked=unchecked) == set()
    assert comparable_replicas("e", averaging, unchecked=unchecked) == set()
    assert "bf16" in unchecked["c"] and "local-step" in unchecked["e"]


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


def test_the_schedule_verifies_forward_calls_and_goes_on_with_the_majority():
    """Two stages: stage 0's forward is checked, and the liar's answer never reaches stage 1."""

    class TwoStages(ScriptedReplicas):
        async def exchange(self, peer_id, *, rpc, stage, microbatch_id, batch_size, tensors, response_codec, **kw):
            if stage == 0 and rpc == "forward":
                return await super().exchange(
                    peer_id,
                    rpc=rpc,
                    stage=stage,
                    microbatch_id=microbatch_id,
                    batch_size=batch_size,
                    tensors=tensors,
                    response_codec=response_codec,
                )
            self.calls.append({"peer": peer_id, "rpc": rpc, "stage": stage, "tensors": dict(tensors)})
            grad = torch.ones(batch_size, T, D)
            outputs = {"grad_inputs": grad} if stage == 1 else {}
            encoded = {n: encode_tensor(t) for n, t in outputs.items()}
            return CallResult(outputs, encoded, ResponseHeader(loss=2.0 if stage == 1 else None, compute_s=0.01), 100)

    client = TwoStages(liars={"peer-liar"})
    view = SwarmView(None, model="tiny", num_stages=2)
    caller = StageCaller(
        view, client, d_model=D, seq_len=T, failover=FailoverSettings(max_retries=2), verify_fraction=1.0
    )
    serve(view, 0, ("peer-a", "peer-b", "peer-liar"))
    serve(view, 1, ("peer-last",))
    schedule = StepSchedule(caller, max_in_flight=1, run_id="run", routing="hub")
    microbatches = [
        Microbatch(step=0, index=i, inputs=activations(i), targets=torch.zeros(B, T, dtype=torch.long))
        for i in range(4)
    ]

    async def run():
        return [await schedule.run_microbatch(mb) for mb in microbatches]

    assert asyncio.run(run()) == [2.0] * 4
    assert caller.counters.calls_verified == 4 and list(caller.counters.banned_peers) == ["peer-liar"]
    sent_on = [decode_tensors({"inputs": c["tensors"]["inputs"]})["inputs"] for c in client.calls if c.get("stage")]
    assert len(sent_on) == 4  # what stage 1 got is always the honest answer
    assert all(any(torch.allclose(x, 2 * activations(i) + 1) for i in range(4)) for x in sent_on)


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


def test_an_undecided_check_counts_a_mismatch_for_both_replicas():
    caller = make_caller(ScriptedReplicas(liars={"peer-liar"}), ["peer-a", "peer-liar"])
    forward_then_verify(caller, order=("peer-a", "peer-liar"))
    for peer in ("peer-a", "peer-liar"):
        entry = caller.contributions.get(peer)
        assert (entry.calls_verified, entry.mismatches, entry.banned) == (1, 1, None)
