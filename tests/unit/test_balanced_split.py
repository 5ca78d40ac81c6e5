"""The balanced splitter: optimal against brute force, deterministic, and explicit about bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.balanced_split import BalancedSplitError, SplitCosts, balanced_split, stage_times


def every_split(num_blocks: int, num_stages: int):
    """Every split of `num_blocks` blocks into `num_stages` non-empty contiguous ranges."""
    for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
        yield (0, *cuts, num_blocks)


def brute_force(costs: SplitCosts, num_stages: int, speeds=None) -> tuple[float, float]:
    """(smallest bottleneck, smallest sum of squares among the splits reaching it)."""
    scored = [stage_times(costs, bounds, speeds) for bounds in every_split(costs.num_blocks, num_stages)]
    bottleneck = min(max(times) for times in scored)
    squares = min(sum(t * t for t in times) for times in scored if max(times) <= bottleneck * (1 + 1e-9))
    return bottleneck, squares


def random_case(rng: np.random.Generator):
    num_blocks = int(rng.integers(1, 10))
    num_stages = int(rng.integers(1, num_blocks + 1))
    # Integer-valued costs make exact ties common, which is where tie-breaking bugs hide.
    integer = rng.random() < 0.5
    draw = (lambda size: rng.integers(0, 6, size).astype(float)) if integer else (lambda size: rng.random(size) * 5)
    costs = SplitCosts(
        block_s=tuple(draw(num_blocks)),
        first_extra_s=float(draw(1)[0]),
        last_extra_s=float(draw(1)[0]),
        cut_s=tuple(draw(num_blocks - 1)) if rng.random() < 0.5 else None,
    )
    speeds = tuple(rng.choice([0.5, 1.0, 2.0, 3.0], size=num_stages)) if rng.random() < 0.5 else None
    return costs, num_stages, speeds


def test_matches_brute_force_on_many_small_cases():
    rng = np.random.default_rng(13)
    for _ in range(400):
        costs, num_stages, speeds = random_case(rng)
        split = balanced_split(costs, num_stages, speeds)
        bottleneck, squares = brute_force(costs, num_stages, speeds)
        assert split.bottleneck_s == pytest.approx(bottleneck, rel=1e-9, abs=1e-12), (costs, num_stages, speeds)
        assert sum(t * t for t in split.stage_times_s) == pytest.approx(squares, rel=1e-9, abs=1e-12)
        assert split.stage_times_s == stage_times(costs, split.boundaries, speeds)
        assert len(split.boundaries) == num_stages + 1


def test_head_and_embedding_weigh_on_their_stages():
    # A heavy head (large vocabulary) pushes blocks towards the first stage.
    costs = SplitCosts(block_s=(1.0,) * 6, first_extra_s=0.0, last_extra_s=2.0)
    assert balanced_split(costs, 2).boundaries == (0, 4, 6)
    costs = SplitCosts(block_s=(1.0,) * 6, first_extra_s=2.0, last_extra_s=0.0)
    assert balanced_split(costs, 2).boundaries == (0, 2, 6)


def test_faster_stages_get_more_blocks():
    costs = SplitCosts(block_s=(1.0,) * 6)
    split = balanced_split(costs, 2, stage_speeds=[1.0, 0.5])  # stage 1 on a device half as fast
    assert split.boundaries == (0, 4, 6)
    assert split.bottleneck_s == pytest.approx(4.0)
    assert max(stage_times(costs, (0, 3, 6), [1.0, 0.5])) == pytest.approx(6.0)


def test_equal_costs_give_the_equal_split_and_ties_are_deterministic():
    costs = SplitCosts(block_s=(1.0,) * 7)
    first = balanced_split(costs, 3)
    assert first.boundaries == (0, 3, 5, 7)  # earlier stages take the remainder, like split_layers
    assert all(balanced_split(costs, 3) == first for _ in range(3))


def test_transfer_cost_discourages_interior_stages_from_taking_less():
    # With a cut cost, the first and last stages (one cut each) can hold more work than the middle.
    costs = SplitCosts(block_s=(1.0,) * 8, cut_s=(1.0,) * 7)
    split = balanced_split(costs, 3)
    assert split.stage_times_s == stage_times(costs, split.boundaries)
    assert split.bottleneck_s == pytest.approx(brute_force(costs, 3)[0])


@pytest.mark.parametrize(
    "kwargs, num_stages, speeds, message",
    [
        (dict(block_s=()), 1, None, "at least one block"),
        (dict(block_s=(1.0, -1.0)), 1, None, ">= 0"),
        (dict(block_s=(1.0, float("nan"))), 1, None, ">= 0"),
        (dict(block_s=(1.0, 1.0), cut_s=(1.0, 1.0)), 1, None, "one entry per cut"),
        (dict(block_s=(1.0, 1.0)), 3, None, "at most 2"),
        (dict(block_s=(1.0, 1.0)), 0, None, "at least 1"),
        (dict(block_s=(1.0, 1.0)), 2, [1.0], "one speed per stage"),
        (dict(block_s=(1.0, 1.0)), 2, [1.0, 0.0], "positive"),
    ],
)
def test_bad_input_is_refused_with_a_reason(kwargs, num_stages, speeds, message):
    with pytest.raises(BalancedSplitError, match=message):
        balanced_split(SplitCosts(**kwargs), num_stages, speeds)


def test_stage_times_refuses_bad_boundaries():
    costs = SplitCosts(block_s=(1.0, 1.0, 1.0))
    for bad in [(0, 3, 3), (1, 3), (0, 2), (0,)]:
        with pytest.raises(BalancedSplitError):
            stage_times(costs, bad)
