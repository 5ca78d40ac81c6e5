"""The learning-rate schedule: warmup, then constant, linear or cosine decay to a floor; and a
stage applies the rate of its own step count, so a split model follows one schedule."""

from __future__ import annotations

import pytest
import torch

from models.config import get_model_config
from models.init_weights import global_name
from models.stages import build_full_model
from peers.compute.lr_schedule import LearningRateSchedule
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from process.config import ConfigError


def test_warmup_rises_linearly_to_the_rate():
    schedule = LearningRateSchedule(2.0, warmup_steps=4)
    assert [schedule.rate(s) for s in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    assert LearningRateSchedule(2.0).rate(0) == 2.0  # no warmup, constant: the plain rate


@pytest.mark.parametrize(
    ("decay", "middle"),
    [("linear", 0.55), ("cosine", 0.55)],  # halfway both are at floor + (1 - floor) / 2
)
def test_decay_falls_from_the_rate_to_the_floor_and_stays(decay, middle):
    schedule = LearningRateSchedule(1.0, warmup_steps=2, decay=decay, decay_steps=10, floor=0.1)
    assert schedule.rate(2) == pytest.approx(1.0)
    assert schedule.rate(7) == pytest.approx(middle)
    assert schedule.rate(12) == pytest.approx(0.1) and schedule.rate(1000) == pytest.approx(0.1)
    rates = [schedule.rate(s) for s in range(2, 13)]
    assert rates == sorted(rates, reverse=True)


def test_cosine_is_above_linear_early_and_below_late():
    cosine = LearningRateSchedule(1.0, decay="cosine", decay_steps=10, floor=0.0)
    linear = LearningRateSchedule(1.0, decay="linear", decay_steps=10, floor=0.0)
    assert cosine.rate(2) > linear.rate(2) and cosine.rate(8) < linear.rate(8)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr_decay": "cosine"}, "needs the number of steps"),
        ({"warmup_steps": -1}, "0 or more"),
        ({"lr_floor": 1.5}, r"\[0, 1\]"),
    ],
)
def test_a_schedule_that_cannot_work_is_refused_at_start(settings, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerSettings(**settings)


def test_a_split_model_follows_the_schedule_step_by_step():
    """SGD with warmup 2 over three steps on the same batch: each stage's update is the rate of
    that step (0.25, 0.5, then 0.5) times its gradient, as a one-process loop with those rates."""
    config = get_model_config("tiny")
    settings = OptimizerSettings(optimizer="sgd", lr=0.5, target_batch_size=4, warmup_steps=2)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=g)
    targets = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=g)

    model = build_full_model(config)
    for rate in (0.25, 0.5, 0.5):
        model.zero_grad()
        model(tokens, targets).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= rate * param.grad

    stages = [StageRuntime(config, s, 2, optimizer=settings) for s in range(2)]
    for step in range(3):
        hidden = stages[0].forward(f"mb{step}", tokens)
        grad, _ = stages[1].backward(f"mb{step}", hidden, targets=targets)
        stages[0].backward(f"mb{step}", tokens, grad_outputs=grad)
    assert [s.steps_done for s in stages] == [3, 3]
    reference = dict(model.named_parameters())
    for stage in stages:
        for local, param in stage.module.named_parameters():
            name = global_name(local, stage.module.spec.first_layer)
            torch.testing.assert_close(param, reference[name], atol=1e-5, rtol=0)
