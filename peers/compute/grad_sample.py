"""A fixed sample of a stage's parameter gradient: what a spot check compares of a backward's work.

A backward's answer is its input gradient (none on stage 0, whose inputs are token ids), but its
work is also the parameter gradient it adds to the replica's accumulation, which leaves the peer
only inside the replicas' all-reduce. So a backward asked for it (`RequestHeader.grad_sample`, every
backward of a run that spot-checks) also answers `GRAD_SAMPLE_SIZE` entries of that parameter
gradient, at positions that depend only on the stage's trainable parameters' shapes: every
replica of a stage samples the same entries, and a second replica recomputing the call must answer
the same values within the tolerance (swarm/trainer/spot_checks.py).

What it shows: a replica whose answered sample comes from a gradient it did not compute from the
call (scaled, noisy, replayed, from stale weights) disagrees with an honest recompute. What it does
not: that the replica adds the gradient it sampled. A liar that answers an honest sample and adds
another gradient is not caught by spot checks (the all-reduce's robust mean is the defence there,
SECURITY.md), nor is one that lies only off the sampled positions, which are no secret.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from wire.protocol import GRAD_SAMPLE_SIZE

_SEED = 0x5A17  # the positions depend on the shapes alone: the same on every replica of a stage


def sample_positions(numels: Sequence[int], size: int = GRAD_SAMPLE_SIZE) -> list[torch.Tensor]:
    """For parameters of `numels` entries, the positions sampled in each (flat indices, sorted):
    `size` positions drawn uniformly over all entries without replacement (all, when fewer)."""
    total = sum(numels)
    if total == 0:
        return [torch.zeros(0, dtype=torch.long) for _ in numels]
    generator = torch.Generator().manual_seed(_SEED + total)
    flat = torch.randperm(total, generator=generator)[: min(size, total)].sort().values
    positions, start = [], 0
    for numel in numels:
        inside = flat[(flat >= start) & (flat < start + numel)] - start
        positions.append(inside)
        start += numel
    return positions


def take_sample(grads: Sequence[torch.Tensor | None], positions: Sequence[torch.Tensor]) -> list[float]:
    """The sampled entries of `grads` (one per parameter; None: no gradient, zeros), as floats."""
    values = []
    for grad, where in zip(grads, positions):
        if where.numel() == 0:
            continue
        if grad is None:
            values.append(torch.zeros(where.numel(), dtype=torch.float64))
        else:
            values.append(grad.detach().reshape(-1)[where.to(grad.device)].to("cpu", torch.float64))
    return torch.cat(values).tolist() if values else []
