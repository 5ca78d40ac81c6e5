"""The robust reduction of the replicas' all-reduce (peers/replicas/robust_mean.py): honest parts give
the plain weighted mean, one liar among 3..5 (or two among 5) moves the result at most the documented
bound, a pair has no defence; and hivemind's reducer, with `RobustPartReducer`, reduces that way, caps
weights and fails a part averaged without a sender that stopped midway."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import AllreduceException, TensorPartReducer

from peers.replicas.averaging_members import RobustPartReducer, reduce_whole_parts_only
from peers.replicas.robust_mean import (
    centered_clip,
    clip_factor,
    coordinate_median,
    robust_mean,
    robust_mean_by_segment,
    segment_lengths,
    tolerated_liars,
    trimmed_mean,
    weighted_mean,
)

SIZE = 4096  # values in a part (hivemind's parts are up to 2**19 bytes: 131072 float32 values)
LIES = {
    "scale": lambda x: x * 10,
    "flip": lambda x: -x,
    "huge": lambda x: x * 1e6,
    "shifted": lambda x: x + 3.0,
}


def honest_parts(n: int, *, seed: int, noise: float = 0.5) -> list[torch.Tensor]:
    """Gradients of replicas that saw different samples: a shared signal plus each one's noise."""
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(SIZE, generator=generator)
    return [signal + noise * torch.randn(SIZE, generator=generator) for _ in range(n)]


def honest_range(parts: list[torch.Tensor]) -> float:
    """R_H: the norm of the honest senders' coordinate-wise range (max - min per coordinate)."""
    stacked = torch.stack(parts)
    return float((stacked.max(dim=0).values - stacked.min(dim=0).values).norm())


def farthest_from_center(parts: list[torch.Tensor], honest: list[torch.Tensor]) -> float:
    """max_h ||x_h - c||, c the coordinate-wise median of every part sent."""
    center = coordinate_median(torch.stack(parts))
    return max(float((h - center).norm()) for h in honest)


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("method", ["clip", "none"])
def test_honest_parts_give_the_plain_weighted_mean(n, method):
    """Unequal weights too: the replica that served w samples has noise ~ 1 / sqrt(w)."""
    generator = torch.Generator().manual_seed(n)
    signal = torch.randn(SIZE, generator=generator)
    weights = [float(w) for w in range(1, n + 1)]
    parts = [signal + 0.5 * torch.randn(SIZE, generator=generator) / w**0.5 for w in weights]
    reduced = robust_mean(parts, weights, method)
    assert reduced.clipped == ()
    torch.testing.assert_close(reduced.value, weighted_mean(parts, weights), atol=1e-6, rtol=0)
    expected = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    torch.testing.assert_close(reduced.value, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("lie", list(LIES))
def test_one_liar_moves_the_clipped_mean_at_most_the_bound(n, lie):
    *honest, truth = honest_parts(n, seed=10 * n + len(lie), noise=0.1)  # noise well below the signal
    liar = LIES[lie](truth)
    parts, weights = [*honest, liar], [1.0] * n  # the liar last: the reducer does not know who it is
    reduced = centered_clip(parts, weights)
    honest_mean = weighted_mean(honest, weights[:-1])
    moved = float((reduced.value - honest_mean).norm())
    share = weights[-1] / sum(weights)

    assert reduced.clipped == (n - 1,)  # only the liar, so the tight bound applies
    factor = clip_factor(SIZE)
    farthest_honest = farthest_from_center(parts, honest)
    assert reduced.radius <= factor * farthest_honest + 1e-4  # weights 1: z is the distance
    assert moved <= share * farthest_honest + share * reduced.radius + 1e-4
    assert moved <= (1 + factor) * share * honest_range(honest) + 1e-4
    # without the clip the liar moves the mean by its share of its whole lie: here beyond the bound
    # (a lie no larger than the honest spread, e.g. a flipped gradient that is mostly noise, is not)
    undefended = float((weighted_mean(parts, weights) - honest_mean).norm())
    assert undefended == pytest.approx(share * float((liar - honest_mean).norm()), rel=1e-4)
    assert undefended > (1 + factor) * share * honest_range(honest)


@pytest.mark.parametrize("size", [32, 96, 1024])
@pytest.mark.parametrize("weights", [[2.0, 2.0, 2.0], [6.0, 4.0, 2.0], [8.0, 2.0, 2.0], [5.0, 4.0, 2.0, 1.0]])
def test_honest_replicas_of_unequal_shares_are_not_clipped_even_in_small_parts(size, weights):
    """hivemind's parts are whole tensors (a bias: 32 values); a replica that served w samples has
    noise ~ 1 / sqrt(w). Fifty draws each: none clipped; a x10 liar in the same parts always is."""
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        signal = torch.randn(size, generator=generator)
        parts = [signal + torch.randn(size, generator=generator) / w**0.5 for w in weights]
        assert centered_clip(parts, weights).clipped == (), seed
        lying = [*parts[:-1], parts[-1] * 10]
        assert centered_clip(lying, weights).clipped == (len(weights) - 1,), seed


def test_the_bound_scales_with_the_liars_weight_share():
    honest = honest_parts(2, seed=3)
    liar = honest[0] * 10
    honest_mean = weighted_mean(honest, [5.0, 5.0])
    light = centered_clip([*honest, liar], [5.0, 5.0, 1.0])
    heavy = centered_clip([*honest, liar], [5.0, 5.0, 10.0])
    for reduced, weights in ((light, [5.0, 5.0, 1.0]), (heavy, [5.0, 5.0, 10.0])):
        share, root_share = weights[2] / sum(weights), weights[2] ** 0.5 / sum(weights)
        farthest_honest = farthest_from_center([*honest, liar], honest)
        bound = share * farthest_honest + root_share * reduced.radius
        assert float((reduced.value - honest_mean).norm()) <= bound + 1e-4
    assert float((light.value - honest_mean).norm()) < float((heavy.value - honest_mean).norm())


def test_two_liars_among_five_are_bounded_too():
    assert tolerated_liars(5) == 2 and tolerated_liars(3) == 1 and tolerated_liars(2) == 0
    honest = honest_parts(3, seed=5)
    liars = [honest[0] * 10, -honest[1] * 10]
    reduced = centered_clip([*honest, *liars], [1.0] * 5)
    assert set(reduced.clipped) == {3, 4}
    moved = float((reduced.value - weighted_mean(honest, [1.0] * 3)).norm())
    assert moved <= 2 / 5 * (farthest_from_center([*honest, *liars], honest) + reduced.radius) + 1e-4


def test_a_liar_sending_non_finite_values_adds_nothing():
    honest = honest_parts(2, seed=6)
    for bad in (torch.full((SIZE,), float("nan")), torch.full((SIZE,), float("inf"))):
        reduced = centered_clip([*honest, bad], [1.0, 1.0, 1.0])
        assert reduced.clipped == (2,) and bool(reduced.value.isfinite().all())
        moved = float((reduced.value - weighted_mean(honest, [1.0, 1.0])).norm())
        assert moved <= 1 / 3 * (farthest_from_center([*honest, bad], honest) + reduced.radius) + 1e-4


@pytest.mark.parametrize("method", ["clip", "trim"])
def test_a_replica_that_served_no_sample_takes_no_part(method):
    """In sync mode a replica that saw no sample of the step sends zeros with a weight of 1e-9."""
    honest = honest_parts(3, seed=9)
    parts, weights = [*honest, torch.zeros(SIZE)], [6.0, 4.0, 2.0, 1e-9]
    reduced = robust_mean(parts, weights, method)
    assert reduced.clipped == ()
    expected = weighted_mean(honest, weights[:3]) if method == "clip" else trimmed_mean(honest, weights[:3]).value
    torch.testing.assert_close(reduced.value, expected, atol=1e-6, rtol=0)
    assert robust_mean([honest[0], -honest[0] * 10, torch.zeros(SIZE)], [1.0, 1.0, 1e-9], method).clipped == ()


def test_identical_honest_parts_are_kept_exactly_whatever_the_liar_sends():
    value = honest_parts(1, seed=7)[0]
    reduced = centered_clip([value, value.clone(), value * -1e3], [1.0, 1.0, 1.0])
    assert reduced.radius == 0.0 and torch.equal(reduced.value, value)


@pytest.mark.parametrize("n", [3, 4, 5])
def test_the_trimmed_mean_stays_within_the_honest_range_but_is_not_the_mean(n):
    honest = honest_parts(n - tolerated_liars(n), seed=n)
    liars = [h * -10 for h in honest[: tolerated_liars(n)]]
    stacked = torch.stack(honest)
    reduced = trimmed_mean([*honest, *liars], [1.0] * n)
    assert bool((reduced.value >= stacked.min(dim=0).values - 1e-6).all())
    assert bool((reduced.value <= stacked.max(dim=0).values + 1e-6).all())
    nobody_lies = trimmed_mean(honest_parts(n, seed=n), [1.0] * n)
    assert not torch.allclose(nobody_lies.value, weighted_mean(honest_parts(n, seed=n), [1.0] * n), atol=1e-3)


@pytest.mark.parametrize("method", ["clip", "trim"])
def test_a_pair_cannot_tell_the_liar_and_gets_the_plain_mean(method):
    """Documented: with two senders either may be the liar; only its weight share bounds its effect."""
    honest, liar = honest_parts(2, seed=8)[0], honest_parts(2, seed=8)[1] * 10
    reduced = robust_mean([honest, liar], [1.0, 3.0], method)
    torch.testing.assert_close(reduced.value, weighted_mean([honest, liar], [1.0, 3.0]), atol=0, rtol=0)
    moved = float((reduced.value - honest).norm())
    assert moved == pytest.approx(3 / 4 * float((liar - honest).norm()), rel=1e-5)


def test_robust_mean_refuses_what_it_cannot_average():
    with pytest.raises(ValueError, match="unknown robust averaging"):
        robust_mean(honest_parts(3, seed=1), [1.0] * 3, "median-of-means")
    with pytest.raises(ValueError, match="positive weight"):
        robust_mean(honest_parts(3, seed=1), [1.0, 0.0, 1.0], "clip")


@pytest.mark.parametrize("method", ["clip", "trim"])
def test_hiveminds_reducer_with_the_robust_accumulator_reduces_each_part_robustly(method):
    """RobustPartReducer under hivemind's own accumulate_part protocol: four senders, two parts,
    arriving in any order; each sender gets the robust mean of the part. Sender 2 lies (x10);
    sender 3 sends noise with a negative weight, which counts as (almost) none: it takes no part."""
    honest = [honest_parts(3, seed=s) for s in (11, 12)]  # [part][sender]
    parts = [[*p[:2], p[2] * 10, torch.randn(SIZE) * 1e3] for p in honest]
    weights = [1.0, 2.0, 3.0, -5.0]

    async def run():
        reducer = RobustPartReducer((torch.Size([SIZE]), torch.Size([SIZE])), 4, method=method)

        async def sender(index: int):
            return [await reducer.accumulate_part(index, p, parts[p][index], weight=weights[index]) for p in (0, 1)]

        results = await asyncio.gather(sender(2), sender(3), sender(0), sender(1))
        reducer.finalize()
        return reducer, results

    reducer, results = asyncio.run(run())
    for part in (0, 1):
        expected = robust_mean(parts[part][:3], weights[:3], method).value
        for sender_results in results:
            torch.testing.assert_close(sender_results[part], expected, atol=0, rtol=0)
    assert reducer.parts_reduced == 2
    assert reducer.parts_clipped == (2 if method == "clip" else 0)


@pytest.mark.parametrize("robust", [False, True])
def test_a_part_averaged_without_a_sender_that_stopped_midway_fails_for_every_sender(robust):
    """Three senders, two parts; sender 2's stream breaks after its first part (hivemind bans it).
    Part 0 had everyone: the (capped) mean. hivemind would average part 1 over senders 0 and 1 and
    call it success; here both get an error for it, so the round fails on every side."""
    shapes = (torch.Size([2]), torch.Size([2]))

    async def run():
        reducer = RobustPartReducer(shapes, 3, method="clip") if robust else TensorPartReducer(shapes, 3)
        reduce_whole_parts_only(reducer, caps=[1.0, 1.0, 1.0])
        first = await asyncio.gather(
            *(
                reducer.accumulate_part(i, 0, torch.full((2,), float(i)), weight=1e9 if i == 2 else 1.0)
                for i in range(3)
            )
        )
        reducer.on_sender_failed(2)  # what hivemind's handler does when the stream breaks
        second = await asyncio.gather(
            *(reducer.accumulate_part(i, 1, torch.ones(2)) for i in range(2)), return_exceptions=True
        )
        reducer.finalize()
        return first, second

    first, second = asyncio.run(run())
    for averaged in first:  # sender 2 declared a weight of 1e9; its cap is 1: the plain mean
        torch.testing.assert_close(averaged, torch.full((2,), 1.0))
    assert len(second) == 2
    for failed in second:
        assert isinstance(failed, AllreduceException), failed
        assert "without 1 groupmate(s) that stopped sending midway" in str(failed)


def test_a_part_of_a_flat_buffer_is_cut_where_its_tensors_meet():
    sizes = [32, 1000, 32, 5000]  # a bias, a weight, a bias, a weight, one after another
    assert segment_lengths(0, 32, sizes) == [32]
    assert segment_lengths(0, 2000, sizes) == [32, 1000, 32, 936]
    assert segment_lengths(40, 1000, sizes) == [992, 8]
    assert segment_lengths(1064, 5000, sizes) == [5000]
    with pytest.raises(ValueError, match="not within"):
        segment_lengths(6000, 100, sizes)


def test_a_lie_in_one_small_tensor_of_a_flat_part_is_clipped_by_that_tensors_spread():
    """A flat buffer's part spans a 32-value bias and a 4,064-value weight. One liar of three shifts
    every bias value by 8 and sends the weight honestly. Reduced whole, the part's large honest spread
    hides the lie (nothing clipped) and the bias moves past the bound its own spread gives; reduced
    tensor by tensor, the bias is clipped and stays within it. Ten draws."""
    segments = segment_lengths(0, SIZE, [32, SIZE - 32])
    weights = [1.0, 1.0, 1.0]
    for seed in range(10):
        honest = honest_parts(3, seed=seed)
        lying = [*honest[:2], torch.cat([honest[2][:32] + 8.0, honest[2][32:]])]
        honest_bias = [h[:32] for h in honest[:2]]  # H: the two honest senders
        bound = (1 + clip_factor(32)) * (1 / 3) * honest_range(honest_bias)
        honest_mean = weighted_mean(honest_bias, weights[:2])
        whole = robust_mean(lying, weights, "clip")
        by_tensor = robust_mean_by_segment(lying, weights, segments, "clip")
        assert whole.clipped == () and by_tensor.clipped == (2,), seed
        assert float((whole.value[:32] - honest_mean).norm()) > bound, seed
        assert float((by_tensor.value[:32] - honest_mean).norm()) <= bound, seed
        # honest senders alone: the plain mean, tensor by tensor as whole
        torch.testing.assert_close(
            robust_mean_by_segment(honest, weights, segments).value, weighted_mean(honest, weights)
        )


def test_hiveminds_reducer_reduces_a_flat_part_tensor_by_tensor():
    """RobustPartReducer with `part_segments`: the part's pieces are reduced one by one."""
    honest = honest_parts(3, seed=8)
    parts = [*honest[:2], torch.cat([honest[2][:32] + 8.0, honest[2][32:]])]

    async def run():
        reducer = RobustPartReducer((torch.Size([SIZE]),), 3, method="clip", part_segments=[[32, SIZE - 32]])
        results = await asyncio.gather(*(reducer.accumulate_part(i, 0, parts[i], weight=1.0) for i in range(3)))
        reducer.finalize()
        return reducer, results

    reducer, results = asyncio.run(run())
    expected = robust_mean_by_segment(parts, [1.0] * 3, [32, SIZE - 32]).value
    for result in results:
        torch.testing.assert_close(result, expected, atol=0, rtol=0)
    assert reducer.parts_clipped == 1
