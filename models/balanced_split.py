"""Stage boundaries that minimise the slowest stage's time: a pure function over layer costs.

The model is a chain: the embedding (always on the first stage), blocks 0..n-1 cut into
contiguous ranges, and the head with the loss (always on the last stage). A stage's time per
microbatch is the cost of what it holds, plus the cost of each cut it sits next to (sending or
receiving an activation), divided by the stage's expected aggregate throughput (its speed
relative to the device the costs were measured on; 2.0 = twice as fast, e.g. two replicas).

`balanced_split` is exact: a dynamic programme over (stage, last block) finds the smallest
possible bottleneck, and a second one picks, among the splits that reach it, the one with the
smallest sum of squared stage times (so the stages that are not the bottleneck are balanced too).
Exact ties go to later cuts, so equal costs give `split_layers`' equal split (earlier stages take
the remainder). No I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BalancedSplitError",
    "SplitCosts",
    "BalancedSplit",
    "stage_times",
    "balanced_split",
    "memory_balanced_boundaries",
]

# Relative slack within which two bottlenecks count as equal.
_TIE = 1e-9


class BalancedSplitError(ValueError):
    """Costs, speeds or a number of stages the model cannot be split with; the message says why."""


@dataclass(frozen=True)
class SplitCosts:
    """The costs a split is judged on, in seconds per microbatch on the measuring device.

    block_s: forward + backward of each block, in model order (n entries).
    first_extra_s: what only the first stage carries (the embedding).
    last_extra_s: what only the last stage carries (final norm, head and loss).
    cut_s: cost of a cut after block k-1 (k = 1..n-1), charged to both stages next to it (the
        activation sent forward and its gradient sent back); None for no transfer cost.
    """

    block_s: tuple[float, ...]
    first_extra_s: float = 0.0
    last_extra_s: float = 0.0
    cut_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        blocks = tuple(float(c) for c in self.block_s)
        object.__setattr__(self, "block_s", blocks)
        if not blocks:
            raise BalancedSplitError("a model needs at least one block to split")
        values = [*blocks, self.first_extra_s, self.last_extra_s]
        if self.cut_s is not None:
            cuts = tuple(float(c) for c in self.cut_s)
            object.__setattr__(self, "cut_s", cuts)
            if len(cuts) != len(blocks) - 1:
                raise BalancedSplitError(f"cut_s needs one entry per cut position ({len(blocks) - 1}), got {len(cuts)}")
            values += cuts
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise BalancedSplitError("every cost must be a finite number of seconds >= 0")

    @property
    def num_blocks(self) -> int:
        return len(self.block_s)


@dataclass(frozen=True)
class BalancedSplit:
    """A split and what it costs.

    boundaries: (0, b_1, ..., n): stage i holds blocks b_i .. b_{i+1}-1.
    stage_times_s: each stage's time per microbatch (cost / speed).
    """

    boundaries: tuple[int, ...]
    stage_times_s: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time: what bounds a pipeline's throughput."""
        return max(self.stage_times_s)


def _speeds(num_stages: int, stage_speeds: Sequence[float] | None) -> np.ndarray:
    if num_stages < 1:
        raise BalancedSplitError(f"num_stages must be at least 1, got {num_stages}")
    if stage_speeds is None:
        return np.ones(num_stages)
    speeds = np.asarray(stage_speeds, dtype=np.float64)
    if speeds.shape != (num_stages,):
        raise BalancedSplitError(f"need one speed per stage ({num_stages}), got {len(speeds)}")
    if not (np.isfinite(speeds).all() and (speeds > 0).all()):
        raise BalancedSplitError(f"stage speeds must be positive and finite, got {list(stage_speeds)}")
    return speeds


def _work_table(costs: SplitCosts, num_stages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """prefix (n+1,), cut at each boundary position (n+1,) (0 at the ends), and extras (S,)."""
    prefix = np.concatenate([[0.0], np.cumsum(costs.block_s)])  # (n+1,)
    cut = np.zeros(costs.num_blocks + 1)  # cut[k]: a stage starting or ending at block k pays this
    if costs.cut_s is not None:
        cut[1:-1] = costs.cut_s
    extras = np.zeros(num_stages)
    extras[0] += costs.first_extra_s
    extras[-1] += costs.last_extra_s
    return prefix, cut, extras


def stage_times(
    costs: SplitCosts, boundaries: Sequence[int], stage_speeds: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Each stage's time per microbatch under a given split (the equal one, say)."""
    bounds = tuple(int(b) for b in boundaries)
    num_stages = len(bounds) - 1
    speeds = _speeds(num_stages, stage_speeds)
    n = costs.num_blocks
    if num_stages < 1 or bounds[0] != 0 or bounds[-1] != n or any(b >= a for b, a in zip(bounds, bounds[1:])):
        raise BalancedSplitError(f"boundaries must strictly increase from 0 to {n}, got {list(bounds)}")
    prefix, cut, extras = _work_table(costs, num_stages)
    return tuple(
        float((prefix[b] - prefix[a] + cut[a] + cut[b] + extras[j]) / speeds[j])
        for j, (a, b) in enumerate(zip(bounds, bounds[1:]))
    )


def balanced_split(costs: SplitCosts, num_stages: int, stage_speeds: Sequence[float] | None = None) -> BalancedSplit:
    """The split of `costs.block_s` into `num_stages` contiguous, non-empty ranges whose slowest
    stage is as fast as possible (exact), then with the smallest sum of squared stage times.

    Raises:
        BalancedSplitError: more stages than blocks, or bad costs or speeds.
    """
    speeds = _speeds(num_stages, stage_speeds)
    n = costs.num_blocks
    if num_stages > n:
        raise BalancedSplitError(f"cannot split {n} blocks into {num_stages} stages (at most {n})")
    prefix, cut, extras = _work_table(costs, num_stages)

    def times(stage: int, starts: np.ndarray, end: int) -> np.ndarray:
        """Time of `stage` holding blocks start..end-1, for every start in `starts`."""
        return (prefix[end] - prefix[starts] + cut[starts] + cut[end] + extras[stage]) / speeds[stage]

    # Pass 1: best[j, i] = smallest bottleneck of stages 0..j holding blocks 0..i-1.
    first = np.array([times(0, np.array([0]), i)[0] for i in range(n + 1)])  # (n+1,) stage 0 holds 0..i-1
    first[0] = np.inf  # a stage holds at least one block
    best = np.full((num_stages, n + 1), np.inf)
    best[0] = first
    for j in range(1, num_stages):
        for i in range(j + 1, n + 1):
            starts = np.arange(j, i)  # stage j holds blocks k..i-1, stages before hold 0..k-1
            best[j, i] = np.maximum(best[j - 1, starts], times(j, starts, i)).min()
    bottleneck = best[num_stages - 1, n]
    limit = bottleneck * (1 + _TIE) + 1e-15

    # Pass 2: among splits whose every stage fits under the bottleneck, the least sum of squares.
    squares = np.full((num_stages, n + 1), np.inf)
    choice = np.zeros((num_stages, n + 1), dtype=np.int64)
    squares[0] = np.where(first <= limit, first * first, np.inf)
    for j in range(1, num_stages):
        for i in range(j + 1, n + 1):
            starts = np.arange(j, i)
            t = times(j, starts, i)
            total = np.where(t <= limit, squares[j - 1, starts] + t * t, np.inf)
            pick = len(total) - 1 - int(np.argmin(total[::-1]))  # ties: the later cut (earlier stages take more)
            squares[j, i], choice[j, i] = total[pick], starts[pick]
    bounds = [n]
    for j in range(num_stages - 1, 0, -1):
        bounds.append(int(choice[j, bounds[-1]]))
    bounds.append(0)
    boundaries = tuple(reversed(bounds))
    return BalancedSplit(boundaries, stage_times(costs, boundaries, speeds))


def memory_balanced_boundaries(
    *, block_parameters: int, n_layers: int, embedding_parameters: int, head_parameters: int, num_stages: int
) -> tuple[int, ...]:
    """The split whose stages hold as equal a share of the model's parameters as whole blocks allow:
    the end stages, which also hold the vocabulary matrices, get fewer blocks. What a peer serving
    one stage keeps in memory is its parameters (and their optimizer state, in proportion), so this
    is the split to use when memory, not compute, decides who can serve (`--split-boundaries memory`).
    """
    costs = SplitCosts(
        block_s=(float(block_parameters),) * n_layers,
        first_extra_s=float(embedding_parameters),
        last_extra_s=float(head_parameters),
    )
    return balanced_split(costs, num_stages).boundaries
