"""Plausible lies (issue #25): a FaultyStageRuntime around the `tiny` model's middle stage answers with
the right shape and finite values, but not what its weights compute (peers/compute/faults.py)."""

import contextlib
import dataclasses

import pytest
import torch

from models.config import get_model_config
from peers.compute.faults import FaultSettings, FaultyStageRuntime, LyingContribution
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from process.config import ConfigError

CONFIG = get_model_config("tiny")
BATCH = 2


def pair(kind: str, **settings) -> tuple[StageRuntime, FaultyStageRuntime]:
    """An honest runtime of stage 1 of 3 and a lying one with the same initial weights."""
    optimizer = OptimizerSettings(target_batch_size=BATCH, optimizer="sgd", lr=0.5)
    honest = StageRuntime(CONFIG, 1, 3, optimizer=optimizer)
    liar = FaultyStageRuntime(
        StageRuntime(CONFIG, 1, 3, optimizer=optimizer), FaultSettings(fault_garbage=kind, **settings)
    )
    return honest, liar


def activations(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, CONFIG.seq_len, CONFIG.d_model, generator=torch.Generator().manual_seed(seed))


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def train_one_step(runtime, seed: int = 99) -> None:
    """One microbatch forward and backward: the runtime steps (target batch BATCH)."""
    inputs = activations(seed)
    runtime.forward("train", inputs)
    runtime.backward("train", inputs, grad_outputs=torch.ones(BATCH, CONFIG.seq_len, CONFIG.d_model))
    assert runtime.steps_done == 1


def test_scale_multiplies_the_outputs_by_one_plus_size():
    honest, liar = pair("scale", fault_garbage_size=0.1)
    inputs = activations(0)
    expected = honest.forward("a", inputs)
    lie = liar.forward("a", inputs)
    assert torch.allclose(lie, expected * 1.1, rtol=1e-5, atol=1e-6)


def test_a_wrong_shape_is_in_the_answer_alone_and_the_liar_still_trains():
    """garbage=shape on a backward: the input gradient comes one value short, the step it takes is
    an honest one (a parameter gradient cannot change shape in the accumulation)."""
    optimizer = OptimizerSettings(target_batch_size=2 * BATCH, optimizer="sgd", lr=0.5)
    honest = StageRuntime(CONFIG, 1, 3, optimizer=optimizer)
    liar = FaultyStageRuntime(StageRuntime(CONFIG, 1, 3, optimizer=optimizer), FaultSettings(fault_garbage="shape"))
    grad_outputs = torch.ones(BATCH, CONFIG.seq_len, CONFIG.d_model)
    for microbatch, seed in (("a", 0), ("b", 1)):  # the second fills the target batch: a step
        inputs = activations(seed)
        honest.forward(microbatch, inputs)
        liar.forward(microbatch, inputs)
        expected, _ = honest.backward(microbatch, inputs, grad_outputs=grad_outputs)
        lie, _ = liar.backward(microbatch, inputs, grad_outputs=grad_outputs)
        assert lie.shape == (*expected.shape[:-1], expected.shape[-1] - 1)
    assert liar.steps_done == honest.steps_done == 1
    for mine, theirs in zip(liar.module.parameters(), honest.module.parameters()):
        assert torch.allclose(mine, theirs)


def test_noise_adds_noise_of_the_given_relative_size():
    honest, liar = pair("noise", fault_garbage_size=0.05)
    inputs = activations(0)
    expected, lie = honest.forward("a", inputs), liar.forward("a", inputs)
    assert lie.shape == expected.shape and torch.isfinite(lie).all()
    assert relative_distance(lie, expected) == pytest.approx(0.05, rel=1e-3)
    assert relative_distance(liar.forward("b", inputs), lie) > 0.01  # fresh noise each time


def test_replay_answers_with_the_previous_answer_of_the_same_shape():
    honest, liar = pair("replay")
    first, second = activations(0), activations(1)
    # The first call has nothing to replay and answers honestly; the second gets the first's answer.
    assert torch.equal(liar.forward("a", first), honest.forward("a", first))
    assert torch.equal(liar.forward("b", second), honest.forward("a", first))
    assert relative_distance(honest.forward("b", second), honest.forward("a", first)) > 0.1


def test_stale_answers_from_the_start_up_weights_while_the_real_ones_train():
    honest, liar = pair("stale")
    inputs = activations(0)
    start_up = honest.forward("a", inputs)
    assert torch.allclose(liar.forward("a", inputs), start_up)  # honest until the weights move
    train_one_step(honest)
    train_one_step(liar)
    trained = honest.forward("b", inputs)
    assert relative_distance(trained, start_up) > 1e-3
    # The lying replica's real weights trained as the honest one's did; its answers did not.
    assert torch.allclose(liar._runtime.forward("b", inputs), trained)
    assert torch.allclose(liar.forward("c", inputs), start_up)
    grad = torch.ones(BATCH, CONFIG.seq_len, CONFIG.d_model)
    stale_grad, _ = liar.backward("c2", inputs, grad_outputs=grad)
    honest_grad, _ = honest.backward("b", inputs, grad_outputs=grad)
    assert stale_grad.shape == honest_grad.shape and relative_distance(stale_grad, honest_grad) > 1e-4


def test_rate_zero_lies_never_and_size_must_be_finite():
    honest, liar = pair("scale", fault_garbage_rate=0.0)
    inputs = activations(0)
    assert torch.equal(liar.forward("a", inputs), honest.forward("a", inputs))
    with pytest.raises(ConfigError):
        FaultSettings(fault_garbage="scale", fault_garbage_size=float("inf"))
    with pytest.raises(ConfigError):
        FaultSettings(fault_garbage="scale", fault_garbage_size=-0.1)


class _Rounds:
    """A replica averaging without a DHT: records what the all-reduce reads from the tensors (when
    it starts without a trigger, or when triggered) and writes `average` on success."""

    def __init__(self, tensors: list[torch.Tensor], average: list[torch.Tensor] | None):
        self.tensors, self.average, self.averager, self.sent = tensors, average, self, None

    def get_tensors(self):
        return contextlib.nullcontext(self.tensors)

    def begin_round(self, group_size, weight, scheduled_time=None, *, wait_for_trigger=False):
        if not wait_for_trigger:
            self.sent = [t.clone() for t in self.tensors]
        return "control"

    def finish_round(self, control):
        if self.sent is None:
            self.sent = [t.clone() for t in self.tensors]
        if self.average is None:
            return None
        for tensor, value in zip(self.tensors, self.average):
            tensor.copy_(value)
        return {"self": 1.0, "other": 1.0}


class _LyingRounds(LyingContribution, _Rounds):
    pass


@pytest.mark.parametrize("lie,factor", [("scale", 10.0), ("flip", -1.0)])
@pytest.mark.parametrize("triggered", [False, True])
def test_a_replica_lying_in_the_all_reduce_sends_its_tensors_multiplied_and_keeps_an_honest_state(
    lie, factor, triggered
):
    honest = [torch.randn(4, 3), torch.randn(5)]
    average = [torch.ones(4, 3), torch.zeros(5)]
    rounds = _LyingRounds([t.clone() for t in honest], average, lie=lie)
    control = rounds.begin_round(3, 1.0, wait_for_trigger=triggered)
    assert rounds.finish_round(control) is not None
    for sent, value in zip(rounds.sent, honest):
        torch.testing.assert_close(sent, value * factor)
    for tensor, value in zip(rounds.tensors, average):  # after the round: the group's average, like everyone
        assert torch.equal(tensor, value)

    failed = _LyingRounds([t.clone() for t in honest], None, lie=lie)  # a round that failed
    assert failed.finish_round(failed.begin_round(3, 1.0, wait_for_trigger=triggered)) is None
    for sent, value in zip(failed.sent, honest):
        torch.testing.assert_close(sent, value * factor)
    for tensor, value in zip(failed.tensors, honest):  # its honest values are back
        assert torch.equal(tensor, value)


def test_fault_averaging_accepts_only_its_lies():
    assert FaultSettings(fault_averaging="flip").fault_averaging == "flip"
    assert not FaultSettings(fault_averaging="scale").enabled  # the stage runtime is not wrapped for it
    with pytest.raises(ConfigError, match="--faults averaging"):
        FaultSettings(fault_averaging="negate")


@pytest.mark.parametrize("kind", ["scale", "stale"])
def test_a_lying_stage_of_a_subspace_model_takes_the_token_ids_as_the_runtime_does(kind):
    """The peer's RPC handlers pass `tokens` to whatever runtime they hold: a faulty one must take
    them (and lie), not fail every call (the spot checks would then never see it answer)."""

    config = dataclasses.replace(CONFIG, subspace_rank=8)
    optimizer = OptimizerSettings(target_batch_size=BATCH, optimizer="sgd", lr=0.5)
    honest = StageRuntime(config, 1, 3, optimizer=optimizer)
    liar = FaultyStageRuntime(StageRuntime(config, 1, 3, optimizer=optimizer), FaultSettings(fault_garbage=kind))
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(BATCH, config.seq_len, 8, generator=generator)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=generator)
    if kind == "stale":  # the frozen weights answer: the real ones must have moved first
        train_one_step_with_tokens(liar, inputs, tokens)
        train_one_step_with_tokens(honest, inputs, tokens)
    told = liar.forward("mb", inputs, None, tokens)
    truth = honest.forward("mb", inputs, None, tokens)
    assert told.shape == truth.shape and torch.isfinite(told).all()
    assert relative_distance(told, truth) > 1e-3
    grad, _ = liar.backward("mb", inputs, grad_outputs=torch.ones_like(truth), tokens=tokens)
    assert grad is not None and grad.shape == inputs.shape


def train_one_step_with_tokens(runtime, inputs: torch.Tensor, tokens: torch.Tensor) -> None:
    outputs = runtime.forward("train", inputs, tokens=tokens)
    runtime.backward("train", inputs, grad_outputs=torch.ones_like(outputs), tokens=tokens)
