"""Weight prediction for sync averaging one step late (`--sync-delay 1`): where to compute a step.

One step late, step t+1's forwards and backwards would run on the parameters after update t-1,
one update behind the exact schedule. A prediction adds a guess at the missing update:

- `last-update`: the last update applied (after PipeMare and SpecTrain). Cheap, but on `small` at
  the demo's peak rate it still ends ~10% above the exact schedule's loss.
- `local-step`: the update the optimizer would make from this replica's own mean gradient of step
  t, which it holds while the group averages it. That is the missing update itself, computed from
  this replica's share of the batch instead of the whole: alone in its stage, a replica computes
  exactly on the exact schedule's parameters; with others, what remains is that the replicas'
  predicted updates do not average to the update of their mean gradient (AdamW is not linear in
  the gradient): on `small`, 2.0-2.6% above the exact schedule's loss, against ~10% for
  `last-update` (benchmarks/RESULTS.md, "Predicting from the replica's own gradients").

Either way the prediction is only where the gradient is evaluated: the optimizer steps the real
parameters with the group's averaged gradient, so replicas stay identical.

`trial_update` is the optimizer's step without its side effects: it works for any optimizer in
torch.optim's mould (state per parameter, `lr` in the param groups), at the cost of one step and a
copy of the state of the parameters it is given. `optimizer_update` uses AdamW's update in closed
form where it can (torch's AdamW, the peers' default optimizer), which reads the state and copies
nothing: on `small`'s stages a third to a half of `trial_update`'s time (benchmarks/RESULTS.md,
"Where a step's CPU goes on 2 cores, and a cheaper local-step prediction"). A replica pays for it
once per step, on the compute thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

WEIGHT_PREDICTIONS = ("local-step", "last-update", "none")


def _copied(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def trial_update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    gradients: Sequence[torch.Tensor],
    rate: float,
) -> list[torch.Tensor]:
    """The update (new minus old) one `optimizer.step()` at learning rate `rate` would make to
    `params` from `gradients`, with the parameters, their gradients, the optimizer's state and its
    learning rates left as they were."""
    saved_state = {
        id(p): {key: _copied(value) for key, value in optimizer.state[p].items()} if p in optimizer.state else None
        for p in params
    }
    saved_grads = [p.grad for p in params]
    saved_rates = [group["lr"] for group in optimizer.param_groups]
    before = [p.detach().clone() for p in params]
    try:
        for param, gradient in zip(params, gradients):
            param.grad = gradient.to(param.dtype).clone()
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.step()
        return [p.detach() - old for p, old in zip(params, before)]
    finally:
        for param, old, grad in zip(params, before, saved_grads):
            param.copy_(old)
            param.grad = grad
            state = saved_state[id(param)]
            if state is None:
                optimizer.state.pop(param, None)
            else:
                optimizer.state[param] = state
        for group, old_rate in zip(optimizer.param_groups, saved_rates):
            group["lr"] = old_rate


def is_plain_adamw(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is torch's AdamW with the update `adamw_update` computes (not amsgrad,
    not maximize; any foreach/fused/capturable setting computes the same update)."""
    return type(optimizer) is torch.optim.AdamW and not any(
        group.get("amsgrad") or group.get("maximize") or not group.get("decoupled_weight_decay", True)
        for group in optimizer.param_groups
    )


@torch.no_grad()
def adamw_update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    gradients: Sequence[torch.Tensor],
    rate: float,
) -> list[torch.Tensor]:
    """The update torch's AdamW would make to `params` from `gradients` at learning rate `rate`, in
    closed form from its state (moments zero and step 0 for a parameter without state): what
    `trial_update` returns, up to float rounding (the step itself multiplies the parameter by
    1 - rate * weight_decay and then adds; this adds the two terms), without touching the
    parameters, their gradients or the optimizer. Only for `is_plain_adamw` optimizers."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    updates = []
    for param, gradient in zip(params, gradients):
        group = group_of[id(param)]
        beta1, beta2 = group["betas"]
        state = optimizer.state.get(param) or {}
        gradient = gradient.to(param.dtype)
        step = float(state["step"]) + 1 if "step" in state else 1.0
        # the moments as the step would update them, by the same operations (so the same roundings)
        exp_avg = state["exp_avg"] if "exp_avg" in state else torch.zeros_like(param)
        exp_avg_sq = state["exp_avg_sq"] if "exp_avg_sq" in state else torch.zeros_like(param)
        first = exp_avg.lerp(gradient, 1 - beta1)
        second = exp_avg_sq.mul(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        denominator = second.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
        update = first.mul_(-rate / (1 - beta1**step)).div_(denominator)
        if group["weight_decay"]:
            update.add_(param.detach(), alpha=-rate * group["weight_decay"])
        updates.append(update)
    return updates


def optimizer_update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    gradients: Sequence[torch.Tensor],
    rate: float,
) -> list[torch.Tensor]:
    """The optimizer's next update from `gradients` at `rate`, nothing touched: `adamw_update` for
    torch's plain AdamW, `trial_update` (a real step, undone) for any other optimizer."""
    if is_plain_adamw(optimizer):
        return adamw_update(optimizer, params, gradients, rate)
    return trial_update(optimizer, params, gradients, rate)
