"""A fixed sketch of a stage's parameter gradient: what a spot check compares of a backward's work.

A backward's answer is its input gradient (none on stage 0, whose inputs are token ids), but its
work is also the parameter gradient it adds to the replica's accumulation, which leaves the peer
only inside the replicas' all-reduce. So a backward asked for it (`RequestHeader.grad_sample`, every
backward of a run that spot-checks) also answers a sample of that parameter gradient:
`GRAD_SAMPLE_SIZE` values, each the sum of `SPREAD` entries at fixed positions, each entry with a
fixed random sign. The positions and signs depend only on the stage's trainable parameters' sizes:
every replica of a stage samples the same entries, and a second replica recomputing the call must
answer the same values within the tolerance (swarm/trainer/spot_checks.py). Summing many entries
per value makes the sample's relative error that of the whole gradient: bf16 rounding moved a sample
of 128 single entries of `tiny`'s last stage by up to 5.3e-3 (sd 8.3e-4), and the whole gradient
and this sample by 3.5e-3 and 3.6e-3 (sd 2.2e-4 and 3.1e-4), over the same 40 calls.

What it shows: a replica whose answered sample comes from a gradient it did not compute from the
call (scaled, noisy, replayed, from stale weights) disagrees with an honest recompute. What it does
not: that the replica adds the gradient it sampled. A liar that answers an honest sample and adds
another gradient is not caught by spot checks (the all-reduce's robust mean is the defence there,
SECURITY.md), nor is one that lies only off the sampled positions, which are no secret.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from wire.protocol import GRAD_SAMPLE_SIZE

SPREAD = 64  # gradient entries summed into each value of the sample
_SEED = 0x5A17  # the positions depend on the sizes alone: the same on every replica of a stage


@dataclass(frozen=True)
class SamplePlan:
    """Where a stage's sample comes from: per parameter, the flat positions read and the slot each
    fills in the sampled entries; the entries' signs; how many values they are summed into."""

    positions: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    signs: torch.Tensor  # float64, one per sampled entry
    values: int


def sample_plan(numels: Sequence[int], size: int = GRAD_SAMPLE_SIZE, spread: int = SPREAD) -> SamplePlan:
    """The plan for parameters of `numels` entries: `size * spread` entries drawn uniformly without
    replacement over all of them (all, when fewer), the i-th drawn summed into value i mod `size`
    (at most `size` values)."""
    total = sum(numels)
    generator = torch.Generator().manual_seed(_SEED + total)
    drawn = torch.randperm(total, generator=generator)[: min(size * spread, total)]
    signs = torch.randint(0, 2, (drawn.numel(),), generator=generator).double() * 2 - 1
    positions, slots, start = [], [], 0
    for numel in numels:
        inside = ((drawn >= start) & (drawn < start + numel)).nonzero().flatten()
        positions.append(drawn[inside] - start)
        slots.append(inside)
        start += numel
    values = min(size, drawn.numel())
    return SamplePlan(tuple(positions), tuple(slots), signs, values)


def take_sample(grads: Sequence[torch.Tensor | None], plan: SamplePlan) -> list[float]:
    """The sample of `grads` (one per parameter; None: no gradient, zeros) by `plan`, as floats."""
    entries = torch.zeros(plan.signs.numel(), dtype=torch.float64)
    for grad, where, slots in zip(grads, plan.positions, plan.slots):
        if grad is not None and where.numel():
            entries[slots] = grad.detach().reshape(-1)[where.to(grad.device)].to("cpu", torch.float64)
    if not plan.values:
        return []
    padded = torch.zeros(-(-entries.numel() // plan.values) * plan.values, dtype=torch.float64)
    padded[: entries.numel()] = entries * plan.signs
    return padded.view(-1, plan.values).sum(0).tolist()
