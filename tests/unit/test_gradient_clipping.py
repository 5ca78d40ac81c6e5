"""Clipping by the global norm over every stage (`swarm train --clip-grad-norm`): the trainer's pure
part (swarm/trainer/schedule.py: the norm from the replicas' "prepare" answers, the scale) and the
replica's two phases (peers/replicas/averaging.py: GradientSync.prepare / apply_prepared), alone."""

import math

import pytest
import torch

from models.config import get_model_config
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from peers.replicas.averaging import GradientSync
from process.config import ConfigError, from_sources
from swarm.trainer.config import TrainerConfig
from swarm.trainer.schedule import clip_scale, global_grad_norm
from wire.protocol import CommitResponse


def prepared(norm_sq: float | None) -> CommitResponse:
    return CommitResponse(averaged=True, group_size=2, grad_norm_sq=norm_sq)


def test_each_stage_counts_once_and_a_stage_with_nothing_prepared_counts_zero():
    answers = {
        0: {"a": prepared(9.0), "b": prepared(9.0)},  # two replicas of one averaged gradient
        1: {"c": prepared(16.0)},
        2: {"d": prepared(None)},  # its round failed: it will not step
    }
    assert global_grad_norm(answers) == pytest.approx(5.0)
    assert global_grad_norm({}) == 0.0


def test_the_scale_is_torchs_clip_coefficient():
    assert clip_scale(5.0, 10.0) == 1.0  # under the bound: unchanged
    assert clip_scale(5.0, 1.0) == pytest.approx(1.0 / (5.0 + 1e-6))
    assert math.isfinite(clip_scale(0.0, 1.0)) and clip_scale(0.0, 1.0) == 1.0
    grads = [torch.full((3,), 2.0), torch.full((4,), 1.0)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    assert norm == pytest.approx(4.0)  # sqrt(3 * 4 + 4 * 1)
    for grad, param in zip(grads, params):
        torch.testing.assert_close(grad * clip_scale(norm, 1.0), param.grad)


class _LoneSync(GradientSync):
    """A sync replica alone in its stage (no averager process): the rounds' bookkeeping only."""

    def __init__(self, runtime):
        self.runtime, runtime.auto_step = runtime, False
        self.buffers = [torch.zeros_like(p) for p in runtime.params]
        self.prepared, self.committed, self.outcomes = None, set(), {}
        self.averager = _Buffers(self.buffers)


class _Buffers:
    def __init__(self, buffers):
        self.buffers = buffers

    def get_tensors(self):
        buffers = self.buffers

        class _Held:
            def __enter__(self):
                return buffers

            def __exit__(self, *exc):
                return False

        return _Held()


def test_a_replica_prepares_without_stepping_then_steps_on_the_scaled_gradient_once():
    config = get_model_config("tiny")
    runtime = StageRuntime(config, 1, 2, optimizer=OptimizerSettings(optimizer="sgd", lr=1.0, target_batch_size=2))
    sync = _LoneSync(runtime)
    x, targets = (
        torch.randn(2, config.seq_len, config.d_model),
        torch.randint(0, config.vocab_size, (2, config.seq_len)),
    )
    runtime.backward("m", x, targets=targets)
    mean = [g.clone() for g in runtime.local_mean_gradients()]
    before = [p.detach().clone() for p in runtime.params]

    outcome = sync.prepare("s", group_size=1)
    assert not outcome.stepped and runtime.steps_done == 0
    assert outcome.grad_norm_sq == pytest.approx(sum(float(g.double().pow(2).sum()) for g in mean), rel=1e-6)
    assert sync.prepare("s", group_size=1) == outcome  # a repeated prepare: the same answer, nothing more

    applied = sync.apply_prepared("s:apply", 0.25)
    assert applied.stepped and runtime.steps_done == 1
    for param, old, grad in zip(runtime.params, before, mean):
        torch.testing.assert_close(param.detach(), old - 0.25 * grad)  # sgd, lr 1: the scaled mean gradient
    stepped = [param.detach().clone() for param in runtime.params]
    # a repeat (another trainer of the run, whose scale may differ): answered as the first, no second step
    assert sync.apply_prepared("s:apply", 0.5) == applied and runtime.steps_done == 1
    for param, after in zip(runtime.params, stepped):
        assert torch.equal(param.detach(), after)
    assert not sync.apply_prepared("t:apply", 0.25).stepped  # nothing prepared: no step


def test_clipping_takes_several_trainers_and_refuses_a_bad_norm_in_one_line():
    config = from_sources(TrainerConfig, env={"SWARM_CLIP_GRAD_NORM": "1", "SWARM_DATA_SHARD": "0/2"})
    assert (config.schedule.clip_grad_norm, config.corpus.shard) == (1.0, (0, 2))
    with pytest.raises(ConfigError, match="clip-grad-norm"):
        from_sources(TrainerConfig, env={"SWARM_CLIP_GRAD_NORM": "-1"})
    assert from_sources(TrainerConfig, env={"SWARM_CLIP_GRAD_NORM": "0.5"}).schedule.clip_grad_norm == 0.5
