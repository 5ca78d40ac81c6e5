"""The DiLoCo-style outer step of periodic averaging (peers/replicas/outer_step.py): pure math."""

from __future__ import annotations

import pytest
import torch

from peers.replicas.outer_step import OuterOptimizer, OuterSettings, outer_step


def test_the_outer_step_is_sgd_with_nesterov_on_the_anchor():
    torch.manual_seed(0)
    settings = OuterSettings(lr=0.7, momentum=0.9)
    anchor = [torch.randn(5, 3), torch.randn(7)]
    reference = [a.clone().requires_grad_(True) for a in anchor]
    sgd = torch.optim.SGD(reference, lr=settings.lr, momentum=settings.momentum, nesterov=True)
    velocity = [torch.zeros_like(a) for a in anchor]
    for _ in range(3):
        average = [a + 0.1 * torch.randn_like(a) for a in anchor]  # where the replicas got to on average
        for param, a, avg in zip(reference, anchor, average):
            param.grad = a - avg
        sgd.step()
        anchor = outer_step(anchor, average, velocity, settings)
        for ours, theirs in zip(anchor, reference):
            torch.testing.assert_close(ours, theirs.detach(), atol=1e-6, rtol=0)


def test_unit_lr_without_momentum_is_the_plain_average():
    anchor, average = [torch.randn(4, 4)], [torch.randn(4, 4)]
    (new,) = outer_step(anchor, average, [torch.zeros(4, 4)], OuterSettings(lr=1.0, momentum=0.0))
    torch.testing.assert_close(new, average[0], atol=1e-6, rtol=0)


def test_the_first_round_keeps_the_average_and_later_rounds_step_from_it():
    outer = OuterOptimizer(OuterSettings(lr=0.5, momentum=0.0))
    params = [torch.full((3,), 2.0)]
    assert not outer.apply(params)  # first round: the average stays, and becomes the anchor
    assert torch.equal(params[0], torch.full((3,), 2.0)) and torch.equal(outer.anchor[0], params[0])
    params[0].copy_(torch.full((3,), 1.0))  # next round's average: the replicas moved by -1
    assert outer.apply(params)
    assert torch.equal(params[0], torch.full((3,), 1.5))  # half of the averaged delta at lr 0.5
    assert torch.equal(outer.anchor[0], params[0])


def test_replicas_with_different_anchors_converge_on_common_averages():
    """A replica that joined late holds another anchor and momentum; since only the common average
    enters the step, the difference shrinks by about sqrt(momentum * (1 - lr)) = 0.52 a round."""
    torch.manual_seed(1)
    settings = OuterSettings()
    a, b = OuterOptimizer(settings), OuterOptimizer(settings)
    a.anchor, a.velocity = [torch.randn(100)], [torch.randn(100)]
    b.anchor, b.velocity = [torch.randn(100)], [torch.zeros(100)]
    first = float((a.anchor[0] - b.anchor[0]).norm())
    average = torch.randn(100)
    for _ in range(20):
        average = average + 0.05 * torch.randn(100)  # the replicas' common average this round
        pa, pb = [average.clone()], [average.clone()]
        a.apply(pa)
        b.apply(pb)
    last = float((pa[0] - pb[0]).norm())
    assert last < first * 0.52**20 * 10, (first, last)
    assert last < 1e-4 * first


@pytest.mark.parametrize("lr, momentum", [(0.0, 0.9), (-1.0, 0.9), (0.7, 1.0), (0.7, -0.1)])
def test_bad_outer_settings_are_refused(lr, momentum):
    with pytest.raises(ValueError):
        OuterSettings(lr=lr, momentum=momentum)
