"""`trial_update` and `optimizer_update`: the optimizer's next update, computed without touching anything."""

import copy

import pytest
import torch

from peers.compute.weight_prediction import adamw_update, optimizer_update, trial_update


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_trial_update_is_the_next_step_and_leaves_parameters_state_and_rates_alone(name):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    }[name]
    optimizer = make(params)
    for _ in range(2):  # some state to keep
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    grads_before = [p.grad.clone() for p in params]
    state_before = copy.deepcopy(optimizer.state_dict())
    values_before = [p.detach().clone() for p in params]
    gradients = [torch.randn_like(p) for p in params]

    update = trial_update(optimizer, params, gradients, rate=5e-3)

    for p, value, grad in zip(params, values_before, grads_before):
        assert torch.equal(p.detach(), value) and torch.equal(p.grad, grad)
    assert optimizer.param_groups[0]["lr"] == 1e-3
    after = optimizer.state_dict()
    for key, state in state_before["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][key][field]), torch.as_tensor(value))
    # the real step at that rate makes exactly that update
    for group in optimizer.param_groups:
        group["lr"] = 5e-3
    for p, gradient in zip(params, gradients):
        p.grad = gradient.clone()
    optimizer.step()
    for p, value, delta in zip(params, values_before, update):
        torch.testing.assert_close(p.detach() - value, delta, atol=0, rtol=0)
    assert any(delta.abs().max() > 0 for delta in update)


def test_trial_update_before_any_step_leaves_no_state_behind():
    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    update = trial_update(optimizer, params, [torch.ones(3)], rate=1e-2)
    assert len(optimizer.state) == 0 and params[0].grad is None
    assert torch.all(update[0] < 0)


def stepped_params(make, steps: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(64, 8)), torch.nn.Parameter(torch.randn(8))]
    optimizer = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("steps", [0, 1, 5])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamws_closed_form_is_its_trial_step_and_touches_nothing(steps, weight_decay):
    """The closed form equals the real step (undone) to the parameters' rounding, before any step
    (no state) and after some, with and without weight decay, and leaves the state alone."""
    params, optimizer = stepped_params(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=weight_decay), steps)
    gradients = [torch.randn_like(p) for p in params]
    state_before = copy.deepcopy(optimizer.state_dict())
    values_before = [p.detach().clone() for p in params]

    closed = adamw_update(optimizer, params, gradients, rate=3e-3)

    assert all(torch.equal(p.detach(), value) for p, value in zip(params, values_before))
    assert len(optimizer.state) == (len(params) if steps else 0)
    for key, state in state_before["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(optimizer.state_dict()["state"][key][field]), torch.as_tensor(value))
    for delta, exact in zip(closed, trial_update(optimizer, params, gradients, rate=3e-3)):
        # the step rounds p * (1 - rate * wd) before adding; a few ulps of |p| (about 1 here)
        torch.testing.assert_close(delta, exact, atol=5e-7, rtol=0)
        assert delta.abs().max() > 1e-4


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1),  # L2 in the gradient, not decoupled
    ],
    ids=["adamw_amsgrad", "sgd_momentum", "adam_l2"],
)
def test_optimizer_update_falls_back_to_the_trial_step_where_the_closed_form_does_not_hold(make):
    params, optimizer = stepped_params(make, 3)
    gradients = [torch.randn_like(p) for p in params]
    for delta, exact in zip(
        optimizer_update(optimizer, params, gradients, rate=3e-3), trial_update(optimizer, params, gradients, rate=3e-3)
    ):
        assert torch.equal(delta, exact)
