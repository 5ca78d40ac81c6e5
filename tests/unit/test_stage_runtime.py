"""The stage runtime alone (no network): split compute equals whole-model compute."""

import dataclasses
import time

import pytest
import torch

from models.config import get_model_config
from models.init_weights import global_name
from models.stages import StageSplitError, build_full_model, split_layers
from peers.compute.stage_runtime import (
    ActivationCacheMissError,
    BadRequestError,
    OptimizerSettings,
    StageRuntime,
    ThroughputMeter,
)


def reference_step(config, tokens, targets, settings, microbatch):
    model = build_full_model(config)
    opt = settings.build(model.parameters())
    loss = model(tokens, targets)
    loss.backward()
    opt.step()
    return loss.item(), model


def pipeline_step(config, tokens, targets, settings, num_stages, microbatch):
    stages = [StageRuntime(config, s, num_stages, optimizer=settings) for s in range(num_stages)]
    losses = []
    for i in range(0, tokens.shape[0], microbatch):
        mb_id, x, y = f"mb{i}", tokens[i : i + microbatch], targets[i : i + microbatch]
        inputs = [x]
        for stage in stages[:-1]:
            inputs.append(stage.forward(mb_id, inputs[-1]))
        grad, loss = stages[-1].backward(mb_id, inputs[-1], targets=y)
        losses.append(loss * x.shape[0])
        for stage, stage_inputs in zip(reversed(stages[:-1]), reversed(inputs[:-1])):
            grad, _ = stage.backward(mb_id, stage_inputs, grad_outputs=grad)
    assert all(s.steps_done == 1 for s in stages)
    return sum(losses) / tokens.shape[0], stages


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_split_training_step_matches_one_process(num_stages, optimizer):
    # SGD makes the update proportional to the gradient (AdamW alone would hide a wrong scale).
    config = get_model_config("tiny")
    settings = OptimizerSettings(optimizer=optimizer, lr=0.5 if optimizer == "sgd" else 1e-3, target_batch_size=8)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len), generator=g)
    targets = torch.randint(0, config.vocab_size, (8, config.seq_len), generator=g)
    ref_loss, ref_model = reference_step(config, tokens, targets, settings, 8)
    loss, stages = pipeline_step(config, tokens, targets, settings, num_stages, microbatch=3)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    reference = dict(ref_model.named_parameters())
    initial = dict(build_full_model(config).named_parameters())
    for stage in stages:
        for local, param in stage.module.named_parameters():
            name = global_name(local, stage.module.spec.first_layer)
            torch.testing.assert_close(param, reference[name], atol=1e-5, rtol=0)
            assert not torch.equal(param, initial[name]), f"{name} was not updated"


def test_activation_cache_is_used_and_retries_are_not_double_counted():
    config = get_model_config("tiny")
    stage = StageRuntime(config, 0, 2, optimizer=OptimizerSettings(target_batch_size=100))
    x = torch.randint(0, config.vocab_size, (2, config.seq_len))
    stage.forward("a", x)
    grad = torch.randn(2, config.seq_len, config.d_model)
    stage.backward("a", x, grad_outputs=grad)
    assert stage.cache_hits == 1
    stage.backward("a", x, grad_outputs=grad)  # a retry of the same microbatch
    assert stage.cache_misses == 1 and stage.samples_accumulated == 2
    assert (stage.samples_trained, stage.backward_repeats) == (2, 1)  # the repeat is counted as one


def test_backward_without_inputs_uses_the_cached_forward_and_equals_a_backward_with_inputs():
    config = get_model_config("tiny")
    settings = OptimizerSettings(optimizer="sgd", lr=0.5, target_batch_size=2)
    with_inputs, without = (
        StageRuntime(config, 1, 3, optimizer=settings),
        StageRuntime(config, 1, 3, optimizer=settings),
    )
    x = torch.randn(2, config.seq_len, config.d_model)
    grad = torch.randn(2, config.seq_len, config.d_model)
    for stage in (with_inputs, without):
        stage.forward("a", x)
    expected, _ = with_inputs.backward("a", x, grad_outputs=grad)
    got, _ = without.backward("a", None, grad_outputs=grad, batch_size=2)
    assert without.cache_hits == 1 and without.steps_done == 1
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    for p, q in zip(with_inputs.module.parameters(), without.module.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_backward_without_inputs_raises_a_cache_miss_when_nothing_current_is_cached():
    config = get_model_config("tiny")
    stage = StageRuntime(config, 1, 3, optimizer=OptimizerSettings(target_batch_size=2))
    x = torch.randn(2, config.seq_len, config.d_model)
    grad = torch.randn(2, config.seq_len, config.d_model)
    with pytest.raises(ActivationCacheMissError):
        stage.backward("never-forwarded", None, grad_outputs=grad)
    stage.forward("a", x)
    stage.forward("b", x)
    with pytest.raises(BadRequestError, match="batch_size says 3"):
        stage.backward("a", None, grad_outputs=grad, batch_size=3)
    stage.backward("b", x, grad_outputs=grad)  # 2 samples: the optimizer steps, cached graphs go stale
    stage.forward("c", x)
    stage.step()
    with pytest.raises(ActivationCacheMissError):
        stage.backward("c", None, grad_outputs=grad)
    assert stage.samples_accumulated == 0  # nothing was accumulated by the refused calls


def test_bad_inputs_are_refused_with_a_clear_error():
    config = get_model_config("tiny")
    stage = StageRuntime(config, 1, 2)
    with pytest.raises(BadRequestError, match="expects inputs of shape"):
        stage.forward("x", torch.randn(2, config.seq_len, config.d_model + 1))
    with pytest.raises(BadRequestError, match="dtype float32"):
        stage.forward("x", torch.zeros(2, config.seq_len, config.d_model, dtype=torch.float64))
    bad = torch.randn(2, config.seq_len, config.d_model)
    bad[0, 0, 0] = float("nan")
    with pytest.raises(BadRequestError, match="NaN"):
        stage.forward("x", bad)
    with pytest.raises(BadRequestError, match="targets"):
        stage.forward("x", torch.randn(2, config.seq_len, config.d_model))


def test_split_layers_is_balanced_and_rejects_bad_counts():
    assert [len(s.layers) for s in split_layers(7, 3)] == [3, 2, 2]
    with pytest.raises(StageSplitError):
        split_layers(2, 3)
    with pytest.raises(StageSplitError):
        split_layers(2, 0)


def test_evaluate_keeps_nothing_and_computes_the_training_forward():
    config = get_model_config("tiny")
    stages = [StageRuntime(config, s, 2, optimizer=OptimizerSettings(target_batch_size=4)) for s in range(2)]
    x = torch.randint(0, config.vocab_size, (2, config.seq_len))
    y = torch.randint(0, config.vocab_size, (2, config.seq_len))
    before = [{k: v.clone() for k, v in s.module.state_dict().items()} for s in stages]
    hidden = stages[0].evaluate(x)
    loss = stages[1].evaluate(hidden, y)
    assert not hidden.requires_grad and loss.dim() == 0
    for stage, state in zip(stages, before):
        assert len(stage.cache) == 0 and stage.samples_accumulated == 0 and stage.steps_done == 0
        assert all(p.grad is None for p in stage.module.parameters())
        assert all(torch.equal(v, state[k]) for k, v in stage.module.state_dict().items())
    reference = build_full_model(config)(x, y)
    torch.testing.assert_close(loss, reference.detach(), atol=1e-6, rtol=0)


def test_a_subspace_stage_needs_the_token_ids_and_a_cached_backward_reuses_them():
    config = dataclasses.replace(get_model_config("tiny"), subspace_rank=8, subspace_kind="fixed")
    settings = OptimizerSettings(optimizer="sgd", lr=0.5, target_batch_size=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, config.seq_len, 8, generator=g)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    grad = torch.randn(2, config.seq_len, 8, generator=g)
    cached, resent = StageRuntime(config, 1, 3, optimizer=settings), StageRuntime(config, 1, 3, optimizer=settings)
    with pytest.raises(BadRequestError, match="needs 'tokens'"):
        cached.forward("a", x)
    with pytest.raises(BadRequestError, match="ids in .tokens. must lie"):
        cached.forward("a", x, tokens=tokens + config.vocab_size)
    out = cached.forward("a", x, tokens=tokens)
    assert out.shape == (2, config.seq_len, 8)
    expected, _ = resent.backward("a", x, grad_outputs=grad, tokens=tokens)  # recomputed with the ids sent
    got, _ = cached.backward("a", None, grad_outputs=grad, batch_size=2)  # the ids come from the cached forward
    assert cached.cache_hits == 1
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    other_tokens = (tokens + 1) % config.vocab_size  # other ids, same inputs: not the cached forward
    cached.forward("b", x, tokens=tokens)
    cached.backward("b", x, grad_outputs=grad, tokens=other_tokens)
    assert cached.cache_misses == 1


def test_weight_prediction_computes_on_the_parameters_plus_the_last_update_and_keeps_them_real():
    config = get_model_config("tiny")
    stage = StageRuntime(config, 0, 1, optimizer=OptimizerSettings(optimizer="sgd", lr=0.5, target_batch_size=2))
    stage.auto_step, stage.weight_prediction = False, "last-update"
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (2, config.seq_len + 1), generator=g) for _ in range(3)]
    taken = []
    for i, batch in enumerate(batches[:2]):
        stage.backward(f"mb{i}", batch[:, :-1], targets=batch[:, 1:])
        taken.append(stage.take_accumulated()[0])
    before = {n: p.detach().clone() for n, p in stage.module.named_parameters()}
    stage.apply_gradients(taken[0])  # one step late: step 0's update after step 1's backward
    after = {n: p.detach().clone() for n, p in stage.module.named_parameters()}
    _, loss = stage.backward("mb2", batches[2][:, :-1], targets=batches[2][:, 1:])
    reference = build_full_model(config)
    with torch.no_grad():
        predicted = {n: 2 * after[n] - before[n] for n in after}
        expected = torch.func.functional_call(reference, predicted, (batches[2][:, :-1], batches[2][:, 1:]))
        unpredicted = torch.func.functional_call(reference, after, (batches[2][:, :-1], batches[2][:, 1:]))
    assert loss == pytest.approx(expected.item(), abs=1e-6)
    assert abs(loss - unpredicted.item()) > 1e-4  # the prediction shows
    for name, value in stage.module.named_parameters():  # what is stepped, saved and sent: the real ones
        torch.testing.assert_close(value.detach(), after[name], atol=0, rtol=0)


def test_forwards_with_a_prediction_share_one_predicted_point_that_follows_the_parameters():
    """Every cached forward computes on the one predicted point (not a parameter copy each); its
    gradients are those of the parameters plus the update; a step, or a new prediction, makes a new one."""
    config = get_model_config("tiny")
    stage = StageRuntime(config, 0, 2)  # AdamW: the closed-form prediction
    stage.auto_step, stage.weight_prediction = False, "local-step"
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g) for _ in range(3)]
    stage.forward("mb0", tokens[0])
    stage.backward("mb0", tokens[0], grad_outputs=torch.ones(2, config.seq_len, config.d_model))
    stage.apply_gradients(stage.take_accumulated()[0])
    stage.predict_local_step([torch.full_like(p, 0.1) for p in stage.params])
    stage.forward("mb1", tokens[1])
    stage.forward("mb2", tokens[2])
    point = stage.cache["mb1"].weights
    assert point is not None and stage.cache["mb2"].weights is point
    for weight, param, update in zip(point, stage.params, stage.predicted_update):
        assert torch.equal(weight, param.detach() + update)
    grad_outputs = torch.randn(2, config.seq_len, config.d_model, generator=g)
    stage.backward("mb1", tokens[1], grad_outputs=grad_outputs)
    with torch.enable_grad():
        shifted = {name: p + u for name, p, u in zip(stage.param_names, stage.params, stage.predicted_update)}
        outputs = torch.func.functional_call(stage.module, shifted, (tokens[1], None), {"tokens": None})
        expected = torch.autograd.grad(outputs, stage.params, grad_outputs=grad_outputs, allow_unused=True)
    for grad_sum, grad in zip(stage.grad_sums, expected):
        torch.testing.assert_close(grad_sum, torch.zeros_like(grad_sum) if grad is None else 2 * grad)
    stage.apply_gradients(stage.take_accumulated()[0])  # the parameters move: so does the point
    stage.forward("mb3", tokens[0])
    moved = stage.cache["mb3"].weights
    assert moved is not point
    for weight, param, update in zip(moved, stage.params, stage.predicted_update):
        assert torch.equal(weight, param.detach() + update)
    stage.stop_predicting()
    stage.forward("mb4", tokens[0])
    assert stage.cache["mb4"].weights is None


def test_local_step_prediction_alone_computes_where_the_exact_schedule_would():
    """A replica alone in its stage, one step late with `local-step`: step 2 runs on the parameters
    plus the update its own step-1 gradients make, which is where the exact schedule computes it."""
    config = get_model_config("tiny")
    # SGD: AdamW would turn the float noise of gradients that are zero in theory (attention's key
    # bias) into full-size steps, so parameters of two exact computations part by ~lr there
    settings = OptimizerSettings(optimizer="sgd", lr=0.5, target_batch_size=2)
    stage = StageRuntime(config, 0, 1, optimizer=settings)
    stage.auto_step, stage.weight_prediction = False, "local-step"
    exact, late = StageRuntime(config, 0, 1, optimizer=settings), StageRuntime(config, 0, 1, optimizer=settings)
    exact.auto_step = late.auto_step = False
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (2, config.seq_len + 1), generator=g) for _ in range(3)]
    pending = late_pending = None
    for i, batch in enumerate(batches):
        _, loss = stage.backward(f"mb{i}", batch[:, :-1], targets=batch[:, 1:])
        _, expected = exact.backward(f"mb{i}", batch[:, :-1], targets=batch[:, 1:])
        _, unpredicted = late.backward(f"mb{i}", batch[:, :-1], targets=batch[:, 1:])
        assert loss == pytest.approx(expected, abs=1e-5)
        if i == 2:
            assert abs(unpredicted - expected) > 1e-4  # one step late without a prediction: elsewhere
        exact.apply_gradients(exact.local_mean_gradients())
        taken, _ = stage.take_accumulated()
        if pending is not None:
            stage.apply_gradients(pending)  # one step late
        stage.predict_local_step(taken)
        pending = taken
        late_taken, _ = late.take_accumulated()
        if late_pending is not None:
            late.apply_gradients(late_pending)
        late_pending = late_taken
    assert stage.steps_done == 2 and exact.steps_done == 3
    stage.apply_gradients(pending)  # the flush: what waits applied, no prediction left
    stage.predict_local_step(None)
    assert stage.predicted_update is None
    for (name, value), reference in zip(stage.module.named_parameters(), exact.module.parameters()):
        torch.testing.assert_close(value.detach(), reference.detach(), atol=1e-6, rtol=1e-5, msg=name)


def test_a_retry_that_arrives_after_the_step_it_was_counted_in_is_not_added_to_the_next():
    """Its first answer was lost, then this peer stepped (with --averaging none it steps by itself
    at --target-batch-size): the retry is answered, its gradients are not added to the new step."""
    config = get_model_config("tiny")
    stage = StageRuntime(config, 1, 3, optimizer=OptimizerSettings(target_batch_size=4))
    x = torch.randn(2, config.seq_len, config.d_model)
    grad = torch.randn(2, config.seq_len, config.d_model)
    for microbatch_id in ("a", "b"):
        stage.backward(microbatch_id, x, grad_outputs=grad)
    assert stage.steps_done == 1 and stage.samples_accumulated == 0  # stepped at 4 samples
    grad_inputs, _ = stage.backward("a", x, grad_outputs=grad)  # the late retry
    assert grad_inputs is not None and grad_inputs.shape == x.shape
    assert stage.samples_accumulated == 0 and stage.backward_repeats == 1
    assert all(not grad_sum.any() for grad_sum in stage.grad_sums)
    stage.backward("c", x, grad_outputs=grad)  # a new microbatch is counted as usual
    assert stage.samples_accumulated == 2 and stage.samples_trained == 6


def test_the_start_up_benchmark_leaves_out_a_slow_first_pass_and_one_slow_timed_pass(monkeypatch):
    """A peer's first pass pays one-time costs, and on a loaded machine any pass may lose its core:
    neither may become the speed it announces (a replica announced 9x too slow got no work at all)."""
    stage = StageRuntime(get_model_config("tiny"), 0, 2, optimizer=OptimizerSettings(target_batch_size=100))
    forward, calls = stage.module.forward, []

    def stalled_twice(*args, **kwargs):
        calls.append(None)
        if len(calls) in (1, 2):  # the warm-up pass, then the first timed pass
            time.sleep(0.3)
        return forward(*args, **kwargs)

    monkeypatch.setattr(stage.module, "forward", stalled_twice)
    samples_per_s = stage.measure_throughput(batch_size=4)
    assert len(calls) >= 3 and samples_per_s > 4 / 0.3
    assert all(p.grad is None for p in stage.module.parameters())  # a benchmark, not a step


def test_served_calls_correct_a_wrong_start_up_speed_within_a_few_calls():
    meter = ThroughputMeter(initial=400.0)  # the benchmark lost its core: the stage serves 3,400/s
    meter.observe(34, 0.01)
    assert meter.value == pytest.approx(1900.0)  # the seed is one observation of two
    for _ in range(8):
        meter.observe(34, 0.01)
    assert meter.value == pytest.approx(3100.0)  # the mean of ten; an EMA of 0.1 would be near 2,200
    for _ in range(200):
        meter.observe(17, 0.01)
    assert meter.value == pytest.approx(1700.0, rel=1e-6)  # then an EMA that follows the present
    unseeded = ThroughputMeter()
    unseeded.observe(5, 1.0)
    assert (unseeded.value, unseeded.observations) == (5.0, 1)


def test_a_moved_peer_carries_its_served_ema_and_its_first_calls_there_do_not_swing_it():
    served = ThroughputMeter(initial=400.0)
    for _ in range(50):
        served.observe(9, 0.01)  # 900/s served on the old stage
    carried = served.carried()
    assert (carried.value, carried.observations) == (served.value, served.observations)
    carried.observe(4, 0.01)  # one call slowed by the move: 400/s
    assert carried.value == pytest.approx(served.value - 0.1 * (served.value - 400.0))  # an EMA step, not a half
    assert served.observations == 51  # the old stage's meter is left as it was
