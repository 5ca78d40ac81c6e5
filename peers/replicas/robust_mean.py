"""Averaging that one lying replica cannot drag far: the reduction of one part of the replicas'
all-reduce (peers/replicas/averaging_members.py applies it where hivemind's reducer averages each
sender's part, `--robust-averaging`).

Senders x_1..x_n (one part each, the same shape), weights w_i > 0 (W their sum). With n >= 3, up to
f = floor((n - 1) / 2) of them may lie (B, total weight W_B); the honest ones H have the weighted
mean mu_H. Both methods start from c, the coordinate-wise median of the parts (unweighted): with
fewer than half the senders lying, each coordinate of c lies within the honest senders' range of
that coordinate, so ||c - mu_H|| <= R_H, the norm of the honest senders' coordinate-wise range
(max - min per coordinate), whatever the liars send.

`clip` (the default): one step of CenteredClip (Karimireddy, He and Jaggi 2021, "Learning from
History for Byzantine Robust Optimization") from c. A sender's deviation is measured against its
weight, z_i = sqrt(w_i) ||x_i - c|| (the mean of w_i samples has noise ~ 1 / sqrt(w_i), so honest
replicas that served unequal shares of a step have alike z), and clipped to its own radius
tau / sqrt(w_i), with tau = F x the (n - f)-th smallest z_i and F = clip_factor(d) = 2 + 8 / sqrt(d)
for a part of d values (a part is one tensor, or up to 128 Ki values of it; a bias of 32 values needs
the larger margin, its distances scatter more). Where hivemind's part of a flat buffer spans several
tensors (sync averaging sends a stage's gradients as one buffer), each tensor's piece of it is
reduced on its own (`robust_mean_by_segment`), so the bound below holds tensor by tensor:

    result = c + sum_i w_i * clip(x_i - c, tau / sqrt(w_i)) / W,   clip(v, r) = v * min(1, r / ||v||)

- Honest inputs: when no z_i exceeds tau (the usual case: honest z are alike), nothing is clipped
  and the result is the plain weighted mean, computed as hivemind computes it (sum of w_i x_i over
  W), so sync replicas still equal one process to float rounding. Measured on the `tiny` model's
  initial weights, six batches, every tensor, three replicas serving 2/2/2, 3/2/1 and 4/1/1 of six
  microbatches: the largest z_(3) / z_(2) was 2.9 (a 32-value bias; F = 3.4 there), so none was
  clipped (without the sqrt(w) and the small-part margin, 37 of 738 tensors were).
- Liars (up to f of n >= 3): tau <= F max_h z_h (the (n - f)-th smallest z is at most the largest
  honest one). If no honest sender is clipped, since
  result - mu_H = (W_B / W)(c - mu_H) + sum_b w_b clip(x_b - c, tau / sqrt(w_b)) / W,

      ||result - mu_H|| <= (W_B / W) max_h ||x_h - c|| + (sum_b sqrt(w_b) / W) tau,

  which for equal weights is <= (1 + F) (W_B / W) max_h ||x_h - c|| <= (1 + F) (W_B / W) R_H.
  In any case ||result - c|| <= tau sum_i sqrt(w_i) / W <= F sqrt(n w_max / W) max_h ||x_h - c||
  (Cauchy-Schwarz), so for equal weights ||result - mu_H|| <= (1 + F) R_H. A liar thus moves the
  result by at most a few times the honest replicas' own spread, however large its lie (x10, a
  flipped sign, 1e30, NaN); without the clip it moves it by (W_B / W) ||x_b - mu_H||, without limit.
  The weights are bounded too: in sync mode the trainer caps each replica's weight at the samples it
  saw it serve (`MemberAverager`); where the trainer counted nothing (periodic mode, where every
  replica sends weight 1), no sender weighs more than the group's median declared weight, so a
  liar declaring 1e6 weighs 1 and the bounds hold for equal weights.
- What it does not give: a lie no larger than the honest spread passes (a flipped gradient of a
  replica whose gradients are mostly noise looks like one more noisy replica; it moves the result
  no more than an honest replica's noise does). An honest replica whose deviation is far out of line
  with the others' is clipped: the result is then not exactly the mean (still the same on every
  replica, and within the bound).

Senders of negligible weight (below NEGLIGIBLE_WEIGHT_SHARE of the largest: in sync mode, a replica
that served no sample of the step and sends zeros) take no part: they would move the plain mean by
less than that share, but as a part far from the others they would pull the median and get honest
ones clipped. n above counts the others.

`trim`: the coordinate-wise trimmed mean: per coordinate, the f largest and f smallest values are
dropped and the rest averaged with their weights. Each coordinate of the result lies within the
honest senders' range, so ||result - mu_H|| <= R_H, but it is not the mean even when nobody lies
(with three senders it is the median), which is why `clip` is the default.

A group of two (or fewer): nothing to compare against, since either sender may be the liar; both
methods return the plain weighted mean. A liar in a pair moves the result by (w_b / W) ||x_b - x_h||:
its weight cap (sync mode) bounds its share, nothing bounds its size. Spot checks
(swarm/trainer/spot_checks.py) catch lies in forward and backward answers, not in averaging.

Also not covered here: the peer that reduces a part sends every sender the averaged part back, so
a replica that lies as a reducer (rather than as a sender, which `--faults averaging` simulates)
decides the 1/n of the values it reduces. Catching that needs the reduction itself verified (as in
BTARD, Gorbunov et al. 2022), which is not done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ROBUST_METHODS = ("none", "clip", "trim")
MIN_ROBUST_GROUP = 3  # below this, no sender can be told apart from another: plain mean
CLIP_FACTOR, CLIP_FACTOR_SMALL_PARTS = 2.0, 8.0  # F = 2 + 8 / sqrt(values in the part)
NEGLIGIBLE_WEIGHT_SHARE = 1e-6


@dataclass(frozen=True)
class Reduced:
    value: torch.Tensor
    clipped: tuple[int, ...] = ()  # senders whose deviation was clipped (`clip` only)
    radius: float = float("inf")  # tau: a sender of weight w is clipped to tau / sqrt(w) (`clip`, >= 3 senders)


def tolerated_liars(num_senders: int) -> int:
    """How many senders may lie while the coordinate-wise median stays within the honest range."""
    return max((num_senders - 1) // 2, 0)


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum w_i x_i / sum w_i, accumulated in order as hivemind's reducer does."""
    total = torch.zeros_like(parts[0])
    for part, weight in zip(parts, weights):
        total.add_(part, alpha=weight)
    return total.div_(sum(weights))


def coordinate_median(stacked: torch.Tensor) -> torch.Tensor:
    """The median of each coordinate over the first dimension (mean of the two middle values for an
    even count: both lie within the honest range when fewer than half lie)."""
    n = stacked.shape[0]
    ordered = stacked.sort(dim=0).values
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def clip_factor(num_values: int) -> float:
    """F for a part of `num_values` values: 2, plus a margin for small parts, whose distances scatter more."""
    return CLIP_FACTOR + CLIP_FACTOR_SMALL_PARTS / max(num_values, 1) ** 0.5


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> Reduced:
    """One CenteredClip step from the coordinate-wise median, deviations measured against the
    senders' weights (see the module's docstring)."""
    n = len(parts)
    if n < MIN_ROBUST_GROUP:
        return Reduced(weighted_mean(parts, weights))
    stacked = torch.stack(list(parts))
    finite = stacked.reshape(n, -1).isfinite().all(dim=1)
    center = coordinate_median(stacked)  # NaN and inf sort last: still within the honest range
    deviations = torch.where(finite.reshape(n, *[1] * (stacked.dim() - 1)), stacked - center, 0.0)
    distances = torch.where(finite, deviations.reshape(n, -1).norm(dim=1), float("inf"))
    root_weights = torch.tensor(weights, dtype=torch.float64).sqrt()
    z = distances.double() * root_weights
    radius = clip_factor(parts[0].numel()) * float(z.sort().values[n - tolerated_liars(n) - 1])
    clipped = tuple(i for i in range(n) if float(z[i]) > radius)
    if not clipped:
        return Reduced(weighted_mean(parts, weights), (), radius)
    # a non-finite part counts as infinitely far: its deviation (zeroed above) adds nothing
    scales = (radius / z.clamp_min(torch.finfo(torch.float64).tiny)).clamp(max=1.0)
    w = torch.tensor(weights, dtype=torch.float64)
    coefficients = (w * scales / w.sum()).to(stacked.dtype)
    shift = (deviations * coefficients.reshape(n, *[1] * (stacked.dim() - 1))).sum(dim=0)
    return Reduced(center + shift, clipped, radius)


def trimmed_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> Reduced:
    """Per coordinate, the weighted mean of the values left after dropping the f largest and f smallest."""
    n = len(parts)
    if n < MIN_ROBUST_GROUP:
        return Reduced(weighted_mean(parts, weights))
    stacked = torch.stack(list(parts))
    values, order = stacked.sort(dim=0)
    w = torch.tensor(weights, dtype=stacked.dtype)[order]
    f = tolerated_liars(n)
    kept_values, kept_weights = values[f : n - f], w[f : n - f]
    return Reduced((kept_values * kept_weights).sum(dim=0) / kept_weights.sum(dim=0))


def segment_lengths(offset: int, length: int, sizes: Sequence[int]) -> list[int]:
    """The part [offset, offset + length) of a flat buffer that holds tensors of `sizes` in order, cut
    where one tensor ends and the next begins: the lengths of its pieces, each within one tensor."""
    if offset < 0 or length < 1 or offset + length > sum(sizes):
        raise ValueError(f"values {offset}..{offset + length} are not within a buffer of {sum(sizes)}")
    pieces, start, end = [], 0, offset + length
    for size in sizes:
        stop = start + size
        if stop > offset and start < end:
            pieces.append(min(stop, end) - max(start, offset))
        start = stop
    return pieces


def robust_mean_by_segment(
    parts: Sequence[torch.Tensor], weights: Sequence[float], segments: Sequence[int], method: str = "clip"
) -> Reduced:
    """`robust_mean` of each segment of the (1-D) parts on its own, put back together: a part that
    spans several tensors of a flat buffer is reduced tensor by tensor (`segment_lengths`), so that a
    lie in one small tensor is measured against that tensor's honest spread, not the whole part's.
    `clipped`: the senders clipped in any segment; `radius`: the largest segment's."""
    if len(segments) <= 1:
        return robust_mean(parts, weights, method)
    pieces = [part.reshape(-1).split(list(segments)) for part in parts]
    reduced = [robust_mean([p[k] for p in pieces], weights, method) for k in range(len(segments))]
    clipped = tuple(sorted({i for r in reduced for i in r.clipped}))
    largest = max(range(len(segments)), key=lambda k: segments[k])
    value = torch.cat([r.value for r in reduced]).view(parts[0].shape)
    return Reduced(value, clipped, reduced[largest].radius)


def robust_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], method: str = "clip") -> Reduced:
    """The reduction of one part over its senders with `method` (one of ROBUST_METHODS)."""
    if not parts:
        raise ValueError("robust_mean needs at least one part")
    if len(parts) != len(weights) or any(not w > 0 for w in weights):
        raise ValueError("robust_mean needs one positive weight per part")
    if method in ("clip", "trim"):
        heaviest = max(weights)
        kept = [i for i, w in enumerate(weights) if w >= NEGLIGIBLE_WEIGHT_SHARE * heaviest]
        if len(kept) < len(parts):
            reduced = robust_mean([parts[i] for i in kept], [weights[i] for i in kept], method)
            return Reduced(reduced.value, tuple(kept[i] for i in reduced.clipped), reduced.radius)
    if method == "clip":
        return centered_clip(parts, weights)
    if method == "trim":
        return trimmed_mean(parts, weights)
    if method == "none":
        return Reduced(weighted_mean(parts, weights))
    raise ValueError(f"unknown robust averaging method {method!r}; use one of {', '.join(ROBUST_METHODS)}")
