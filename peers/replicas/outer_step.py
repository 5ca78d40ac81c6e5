"""The outer step of periodic averaging (DiLoCo-style, Douillard et al. 2023): pure tensor math.

Between rounds each replica takes local optimizer steps from the parameters it held after the last
round (its *anchor*). At a round the replicas average their parameters; the outer gradient is
anchor - average (the averaged parameter delta, sign as a gradient), and the outer optimizer is SGD
with Nesterov momentum:

    g = anchor - average;   v = momentum * v + g;   new = anchor - lr * (g + momentum * v)

which is `torch.optim.SGD(nesterov=True)` applied to the anchor. With lr = 1 and momentum = 0 the
new parameters are the plain average. Replicas that share anchor and momentum (every replica that
took part in every round) compute the same new parameters; one that does not (it joined late or
missed a round) starts from the average, and its difference to the others then shrinks every
round: only the common average enters the step, so the differences of (anchor, v) follow a fixed
linear map, whose spectral radius is sqrt(momentum * (1 - lr)) = 0.52 at DiLoCo's lr 0.7 and
momentum 0.9 (complex eigenvalues there; tests/unit/test_outer_step.py checks the decay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterSettings:
    lr: float = 0.7  # DiLoCo's values
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"the outer learning rate must be positive, not {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"the outer momentum must lie in [0, 1), not {self.momentum}")


def outer_step(
    anchor: list[torch.Tensor], average: list[torch.Tensor], velocity: list[torch.Tensor], settings: OuterSettings
) -> list[torch.Tensor]:
    """New parameters from the anchor and the averaged parameters; updates `velocity` in place."""
    if not len(anchor) == len(average) == len(velocity):
        raise ValueError("anchor, average and velocity must hold the same tensors")
    with torch.no_grad():
        return outer_update(anchor, [a - avg for a, avg in zip(anchor, average)], velocity, settings)


def outer_update(
    anchor: list[torch.Tensor], gradient: list[torch.Tensor], velocity: list[torch.Tensor], settings: OuterSettings
) -> list[torch.Tensor]:
    """New parameters from the anchor and the outer gradient g itself (the replicas' mean pseudo-gradient,
    as outer rounds exchange it, peers/replicas/outer_rounds.py); updates `velocity` in place."""
    if not len(anchor) == len(gradient) == len(velocity):
        raise ValueError("anchor, gradient and velocity must hold the same tensors")
    new = []
    with torch.no_grad():
        for a, g, v in zip(anchor, gradient, velocity):
            v.mul_(settings.momentum).add_(g)
            new.append(a - settings.lr * (g + settings.momentum * v))
    return new


class OuterOptimizer:
    """Anchor and momentum of one replica across rounds. The first round only records the average
    as the anchor (every replica then starts the outer steps from the same point, a joiner too)."""

    def __init__(self, settings: OuterSettings):
        self.settings = settings
        self.anchor: list[torch.Tensor] | None = None
        self.velocity: list[torch.Tensor] | None = None

    def apply(self, params: list[torch.Tensor]) -> bool:
        """`params` hold the round's average; replace it in place with the outer step's result.
        Returns whether a step was taken (not on the first round)."""
        stepped = self.anchor is not None
        with torch.no_grad():
            if not stepped:
                self.velocity = [torch.zeros_like(p) for p in params]
            else:
                for param, value in zip(params, outer_step(self.anchor, list(params), self.velocity, self.settings)):
                    param.copy_(value)
            self.anchor = [p.detach().clone() for p in params]
        return stepped
