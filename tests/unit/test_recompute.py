"""What a spot check compares of a backward, and the checker's recompute (issue #59): the gradient
sample (peers/compute/grad_sample.py), `StageRuntime.recompute` (the answer of a training call,
computed in the precision asked, nothing kept), and a FaultyStageRuntime lying on backward calls
alone: in its input gradient, its loss, and the parameter gradient it adds and samples."""

from __future__ import annotations

import pytest
import torch

from models.config import get_model_config
from peers.compute.faults import FaultSettings, FaultyStageRuntime
from peers.compute.grad_sample import SPREAD, sample_plan, take_sample
from peers.compute.stage_runtime import BadRequestError, OptimizerSettings, StageRuntime
from process.config import ConfigError
from swarm.trainer.spot_checks import PRECISION_ERRORS, TIGHT, relative_difference
from wire.protocol import GRAD_SAMPLE_SIZE

CONFIG = get_model_config("tiny")
B = 2


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (B, CONFIG.seq_len), generator=torch.Generator().manual_seed(seed))


def stages(**kwargs) -> tuple[StageRuntime, StageRuntime]:
    optimizer = OptimizerSettings(target_batch_size=10**6)
    return StageRuntime(CONFIG, 0, 2, optimizer=optimizer, **kwargs), StageRuntime(CONFIG, 1, 2, optimizer=optimizer)


def test_the_sample_sums_fixed_entries_with_fixed_signs_that_depend_on_the_sizes_alone():
    plan, again = sample_plan([10, 100000, 5]), sample_plan([10, 100000, 5])
    assert all(torch.equal(a, b) for a, b in zip(plan.positions, again.positions))
    assert torch.equal(plan.signs, again.signs) and plan.values == GRAD_SAMPLE_SIZE
    assert sum(p.numel() for p in plan.positions) == GRAD_SAMPLE_SIZE * SPREAD
    assert all(p.numel() == 0 or (p.min() >= 0 and p.max() < n) for p, n in zip(plan.positions, [10, 100000, 5]))
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(10, generator=generator), torch.randn(100000, generator=generator), None]
    sample = torch.tensor(take_sample(grads, plan))
    assert sample.numel() == GRAD_SAMPLE_SIZE
    # linear in the gradients (to float32 rounding: a sum that cancels to near 0 has no relative precision)
    assert torch.allclose(
        torch.tensor(take_sample([g * 1.05 if g is not None else None for g in grads], plan)), sample * 1.05, atol=1e-5
    )
    small = sample_plan([3, 4])  # fewer entries than the sample: every one, a value each
    assert small.values == 7 and sorted(abs(v) for v in take_sample([torch.arange(3.0), None], small)) == [
        0,
        0,
        0,
        0,
        0,
        1,
        2,
    ]


def test_a_recompute_answers_what_the_training_call_answered_and_keeps_nothing():
    first, last = stages()
    x, y = tokens(1), tokens(2)
    outputs = first.forward("m", x)
    grad_inputs, loss, sample = last.backward_sampled("m", outputs, targets=y)
    _, _, first_sample = first.backward_sampled("m", None, grad_outputs=grad_inputs, batch_size=B)
    assert len(sample) == len(first_sample) == GRAD_SAMPLE_SIZE and any(first_sample)

    checker_first, checker_last = stages()
    again, _, _ = checker_first.recompute("forward", x)
    assert torch.equal(again, outputs)
    grad_again, loss_again, sample_again = checker_last.recompute("backward", outputs, targets=y)
    assert torch.equal(grad_again, grad_inputs) and loss_again == loss and sample_again == sample
    none, _, first_again = checker_first.recompute("backward", x, grad_outputs=grad_inputs)
    assert none is None and first_again == first_sample
    for runtime in (checker_first, checker_last):  # nothing cached, accumulated or counted
        assert not runtime.cache and runtime.samples_accumulated == 0 and runtime.samples_trained == 0
        assert all(float(g.abs().sum()) == 0.0 for g in runtime.grad_sums)


def test_a_recompute_in_bf16_stays_within_the_bf16_bound_of_float32():
    first, last = stages()
    outputs, _, _ = first.recompute("forward", tokens(3))
    exact = last.recompute("backward", outputs, targets=tokens(4))
    rounded = last.recompute("backward", outputs, targets=tokens(4), precision="bf16")
    bound = TIGHT + PRECISION_ERRORS["bf16"]
    assert 0 < relative_difference(exact[0], rounded[0]) < bound
    assert relative_difference(torch.tensor(exact[2]), torch.tensor(rounded[2])) < bound
    with pytest.raises(BadRequestError, match="fp8"):
        last.recompute("backward", outputs, targets=tokens(4), precision="fp8")


def test_a_recompute_runs_on_the_point_weight_prediction_trains_on():
    first, _ = stages()
    first.weight_prediction = "last-update"
    first.predicted_update = [torch.full_like(p, 0.01) for p in first.params]
    x = tokens(5)
    assert torch.equal(first.recompute("forward", x)[0], first.forward("m", x))
    assert not torch.equal(first.recompute("forward", x)[0], first.evaluate(x))  # evaluate: the parameters


def liar_pair(**settings) -> tuple[StageRuntime, FaultyStageRuntime]:
    optimizer = OptimizerSettings(target_batch_size=10**6)
    honest = StageRuntime(CONFIG, 0, 2, optimizer=optimizer)
    liar = FaultyStageRuntime(StageRuntime(CONFIG, 0, 2, optimizer=optimizer), FaultSettings(**settings))
    return honest, liar


def test_a_backward_liar_answers_forwards_truly_and_lies_in_all_a_backward_makes():
    honest, liar = liar_pair(fault_garbage="scale", fault_garbage_calls="backward", fault_garbage_size=0.05)
    x, grad = tokens(6), torch.randn(B, CONFIG.seq_len, CONFIG.d_model, generator=torch.Generator().manual_seed(7))
    assert torch.equal(liar.forward("m", x), honest.forward("m", x))
    _, _, told = liar.backward_sampled("m", None, grad_outputs=grad, batch_size=B)
    _, _, truth = honest.backward_sampled("m", None, grad_outputs=grad, batch_size=B)
    assert relative_difference(torch.tensor(told), torch.tensor(truth)) == pytest.approx(0.05 / 1.05, rel=1e-4)
    for lied, true in zip(liar.grad_sums, honest.grad_sums):  # what it adds: the same lie
        assert torch.allclose(lied, true * 1.05, atol=1e-9)
    assert liar.samples_accumulated == honest.samples_accumulated == B
    checked = liar.recompute("backward", x, grad_outputs=grad)[2]  # a check it answers lies alike
    assert relative_difference(torch.tensor(checked), torch.tensor(truth)) == pytest.approx(0.05 / 1.05, rel=1e-4)


@pytest.mark.parametrize("kind", ["noise", "replay", "stale"])
def test_every_plausible_backward_lie_shows_in_the_gradient_sample(kind):
    honest, liar = liar_pair(fault_garbage=kind, fault_garbage_calls="backward", fault_garbage_size=0.03)
    for step in range(2):  # replay lies from its second call on; stale once the weights moved
        x = tokens(10 + step)
        grad = torch.randn(B, CONFIG.seq_len, CONFIG.d_model, generator=torch.Generator().manual_seed(step))
        honest.forward(f"m{step}", x), liar.forward(f"m{step}", x)
        _, _, told = liar.backward_sampled(f"m{step}", x, grad_outputs=grad)
        _, _, truth = honest.backward_sampled(f"m{step}", x, grad_outputs=grad)
        for runtime in (honest, liar):
            runtime.step()
    assert relative_difference(torch.tensor(told), torch.tensor(truth)) > 0.02


def test_fault_garbage_calls_accepts_only_its_kinds():
    with pytest.raises(ConfigError, match="--faults garbage_calls"):
        FaultSettings(fault_garbage="scale", fault_garbage_calls="commit")
