"""The offline optimum: assign peers to stages so that the slowest stage is as fast as possible.

Given peers with throughputs ``x_1..x_n`` (samples/s) and ``num_stages`` stages, a pipeline runs
at ``min_j sum_{i in stage j} x_i``. Maximising that minimum is max-min multiway number
partitioning ("machine covering"), NP-hard in general. This module is the yardstick the
rebalancer is measured against, not something a peer runs:

- ``exact_bottleneck``: branch-and-bound, exact; used by ``optimal_bottleneck`` for
  ``n <= EXACT_MAX_PEERS``.
- ``bottleneck_upper_bound``: ``min_k (sum - k largest) / (num_stages - k)``; used by
  ``optimal_bottleneck`` for larger ``n``. Valid because the ``k`` largest peers sit in at most
  ``k`` stages, so the other ``>= num_stages - k`` stages share at most the rest.
- ``greedy_bottleneck``: LPT (largest first, into the currently thinnest stage), a feasible
  assignment and so a lower bound; the gap between it and the upper bound says how tight the
  bound is (for hundreds of peers per stage it is well under 1%).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = [
    "EXACT_MAX_PEERS",
    "bottleneck_upper_bound",
    "exact_bottleneck",
    "greedy_bottleneck",
    "optimal_bottleneck",
]

EXACT_MAX_PEERS = 12
"""Largest peer count for which ``optimal_bottleneck`` runs the exact search."""


def _validated_descending(throughputs: Sequence[float], num_stages: int) -> list[float]:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    values = [float(x) for x in throughputs]
    for x in values:
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"throughputs must be finite and >= 0, got {x!r}")
    return sorted(values, reverse=True)


def bottleneck_upper_bound(throughputs: Sequence[float], num_stages: int) -> float:
    """An upper bound on the best achievable bottleneck (samples/s); 0 if ``n < num_stages``."""
    values = _validated_descending(throughputs, num_stages)
    if len(values) < num_stages:
        return 0.0
    remaining = math.fsum(values)
    best = remaining / num_stages
    for k in range(1, num_stages):
        remaining -= values[k - 1]
        best = min(best, max(remaining, 0.0) / (num_stages - k))
    return best


def greedy_bottleneck(throughputs: Sequence[float], num_stages: int) -> float:
    """Bottleneck of the LPT assignment (a lower bound on the optimum), samples/s."""
    values = _validated_descending(throughputs, num_stages)
    if len(values) < num_stages:
        return 0.0
    loads = [(0.0, stage) for stage in range(num_stages)]  # heap of (load, stage)
    for x in values:
        load, stage = heapq.heappop(loads)
        heapq.heappush(loads, (load + x, stage))
    return loads[0][0]


def exact_bottleneck(throughputs: Sequence[float], num_stages: int) -> float:
    """The exact optimum by branch-and-bound; exponential, meant for a dozen peers or so."""
    values = _validated_descending(throughputs, num_stages)
    n = len(values)
    if n < num_stages:
        return 0.0
    suffix_sums = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_sums[i] = suffix_sums[i + 1] + values[i]
    best = greedy_bottleneck(values, num_stages)

    def search(i: int, loads: tuple[float, ...]) -> None:
        nonlocal best
        if i == n:
            best = max(best, min(loads))
            return
        # Bound: the k thinnest stages can at best share everything not yet placed.
        prefix = 0.0
        for k, load in enumerate(sorted(loads), start=1):
            prefix += load
            if (prefix + suffix_sums[i]) / k <= best:
                return
        tried: set[float] = set()
        for stage, load in enumerate(loads):
            if load in tried:  # stages with equal load are interchangeable
                continue
            tried.add(load)
            search(i + 1, loads[:stage] + (load + values[i],) + loads[stage + 1 :])

    search(0, (0.0,) * num_stages)
    return best


def optimal_bottleneck(throughputs: Sequence[float], num_stages: int) -> float:
    """Best achievable bottleneck (samples/s) over all assignments of peers to stages.

    Exact (branch-and-bound) for ``len(throughputs) <= EXACT_MAX_PEERS``; above that, the upper
    bound ``bottleneck_upper_bound``, so a share computed against it understates how close a
    policy is to the true optimum (never overstates it).
    """
    if len(throughputs) <= EXACT_MAX_PEERS:
        return exact_bottleneck(throughputs, num_stages)
    return bottleneck_upper_bound(throughputs, num_stages)
