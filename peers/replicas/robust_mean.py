"""Averaging that one lying replica cannot drag far: the reduction of one part of the replicas'
all-reduce (peers/replicas/averaging_members.py applies it, `--robust-averaging`).

Senders x_1..x_n of one part with weights w_i. Both methods start from c, the coordinate-wise
median of the parts, which lies within the honest senders' range while fewer than half lie.

- `clip` (the default): one step of CenteredClip (Karimireddy, He and Jaggi 2021) from c, each
  deviation measured as sqrt(w_i) ||x_i - c|| and clipped beyond `clip_factor(d)` times the
  (n - f)-th smallest; with nothing clipped the result is the plain weighted mean, computed as
  hivemind computes it. `robust_mean_by_segment` reduces each tensor's piece of a flat buffer alone.
- `trim`: the coordinate-wise trimmed mean (never exactly the mean).
- A group of two or fewer, or senders of negligible weight: the plain weighted mean; negligible
  senders take no part.

Bound: with up to f = floor((n - 1) / 2) liars among n >= 3 (equal weights), the result stays
within (1 + F) times the honest replicas' coordinate-wise range of their mean, however large the
lie. Not covered: a lie within the honest spread, and a replica lying as a reducer.
The proof, the measurements and the limits: docs/design/replicas.md.
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
