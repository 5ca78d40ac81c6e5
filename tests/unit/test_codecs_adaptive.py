"""choose_codec (our AdaTopK rule) and LinkBandwidthMeter: pure, deterministic, no network."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.compression import LinkBandwidthMeter, LinkEstimate, choose_codec, encode
from wire.compression.adaptive import (
    MIN_TOPK_FRACTION_ACTIVATION,
    MIN_TOPK_FRACTION_GRADIENT,
    codecs_within,
    estimated_nbytes,
)
from wire.compression.policy import CodecPolicy

MB = 1_000_000
ACTIVATION_BYTES = 16 * 128 * 256 * 4  # a (B=16, T=128, d=256) float32 activation: 2 MiB
ORDER = {"none": 0, "fp16": 1, "int8": 2, "int4": 3, "topk": 4}


def link(bandwidth_bytes_per_s: float, latency_s: float = 0.02) -> LinkEstimate:
    return LinkEstimate(bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s)


def test_very_fast_link_sends_uncompressed():
    choice = choose_codec(link(10_000 * MB), ACTIVATION_BYTES, target_transfer_s=0.1, is_gradient=False)
    assert choice.codec == "none" and choice.params == {}
    assert choice.estimated_nbytes == ACTIVATION_BYTES


def test_the_ladder_goes_fp16_then_int8_then_int4_then_topk_as_bandwidth_falls():
    """fp16 once it saves more wire time than it costs CPU, int8 likewise (below ~450 Mbit/s),
    int4 when int8 would take over 4x the target, top-k only when even int4 would."""
    target = 0.1
    codecs = [
        choose_codec(link(bandwidth * MB, 0.0), ACTIVATION_BYTES, target, is_gradient=True).codec
        for bandwidth in (10_000, 1000, 50, 3, 1, 0.5)
    ]
    assert codecs == ["none", "fp16", "int8", "int8", "int4", "topk"]


def test_int4_fills_the_gap_between_int8_and_topk():
    """At 1 MB/s with a 0.1 s target the slack budget is 0.4 MB: int8 (0.53 MB) misses it, int4
    (0.28 MB, every value kept) fits; at 0.5 MB/s (0.2 MB) only top-k does."""
    choice = choose_codec(link(1 * MB, 0.01), ACTIVATION_BYTES, 0.1, is_gradient=False)
    assert choice.codec == "int4" and choice.params == {}
    assert choice.estimated_nbytes == encode(torch.randn(ACTIVATION_BYTES // 4), "int4").nbytes
    assert choice.estimated_transfer_s == pytest.approx(0.01 + choice.estimated_nbytes / MB)
    assert choose_codec(link(0.5 * MB, 0.01), ACTIVATION_BYTES, 0.1, is_gradient=False).codec == "topk"
    sixteen_bit = choose_codec(link(1 * MB, 0.0), ACTIVATION_BYTES // 2, 0.1, is_gradient=True, bytes_per_element=2)
    assert sixteen_bit.codec == "int4"  # 524,288 bf16 values: int8 0.53 MB over, int4 0.28 MB in


def test_cheaper_codecs_are_kept_when_compressing_costs_more_cpu_than_it_saves():
    """At 1 GB/s, int8 would save 3 ms of wire time on 2 MiB and cost ~10 ms of CPU."""
    assert choose_codec(link(1000 * MB), ACTIVATION_BYTES, 10.0, is_gradient=False).codec == "fp16"


def test_a_link_somewhat_too_slow_for_the_target_keeps_int8_rather_than_lossy_topk():
    # 10 Mbit/s: int8 (0.53 MB) takes 0.42 s, 2.1x the 0.2 s target; within the default 4x slack.
    choice = choose_codec(link(1.25 * MB, 0.05), ACTIVATION_BYTES, target_transfer_s=0.2, is_gradient=True)
    assert choice.codec == "int8"
    strict = choose_codec(
        link(1.25 * MB, 0.05), ACTIVATION_BYTES, target_transfer_s=0.2, is_gradient=True, topk_slack=1.0
    )
    assert strict.codec == "topk"


def test_very_slow_link_gets_topk_with_a_fraction_that_fills_the_slack_budget():
    # 2 Mbit/s: int8 would take 2.1 s, over 4x the 0.2 s target.
    slow = link(0.25 * MB, 0.05)
    choice = choose_codec(slow, ACTIVATION_BYTES, target_transfer_s=0.2, is_gradient=True)
    assert choice.codec == "topk"
    assert MIN_TOPK_FRACTION_GRADIENT < choice.params["fraction"] < 0.1  # 33,333 of 524,288 values
    assert choice.estimated_nbytes <= 4 * 0.2 * 0.25 * MB
    assert choice.estimated_transfer_s == pytest.approx(0.05 + choice.estimated_nbytes / (0.25 * MB))


def test_activations_keep_a_higher_topk_floor_than_gradients():
    very_slow = link(0.001 * MB, 0.05)
    gradient = choose_codec(very_slow, ACTIVATION_BYTES, 0.2, is_gradient=True)
    activation = choose_codec(very_slow, ACTIVATION_BYTES, 0.2, is_gradient=False)
    assert gradient.params["fraction"] == MIN_TOPK_FRACTION_GRADIENT
    assert activation.params["fraction"] == MIN_TOPK_FRACTION_ACTIVATION
    assert activation.estimated_transfer_s > 0.2  # the floor wins over the target, and says so
    custom = choose_codec(very_slow, ACTIVATION_BYTES, 0.2, is_gradient=False, min_fraction=0.2)
    assert custom.params["fraction"] == 0.2


def test_latency_does_not_drive_compression():
    """No codec shortens the latency: a fast link with a long RTT still sends uncompressed."""
    choice = choose_codec(link(10_000 * MB, latency_s=1.0), ACTIVATION_BYTES, 0.5, is_gradient=True)
    assert choice.codec == "none" and choice.estimated_transfer_s > 1.0


def test_sixteen_bit_tensors_skip_fp16_which_would_save_nothing():
    choice = choose_codec(link(15 * MB, 0.0), ACTIVATION_BYTES // 2, 0.05, is_gradient=False, bytes_per_element=2)
    assert choice.codec == "int8"


def test_empty_tensor_is_sent_as_none():
    assert choose_codec(link(1.0), 0, 0.1, is_gradient=True).codec == "none"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tensor_nbytes": -4},
        {"tensor_nbytes": 6},  # not a whole number of float32 values
        {"target_transfer_s": 0.0},
        {"target_transfer_s": float("inf")},
        {"bytes_per_element": 3},
        {"min_fraction": 0.0},
        {"min_fraction": 1.5},
        {"topk_slack": 0.5},
    ],
)
def test_invalid_arguments_raise_value_error(kwargs):
    arguments = {"tensor_nbytes": 4096, "target_transfer_s": 0.1, "is_gradient": False, **kwargs}
    with pytest.raises(ValueError):
        choose_codec(link(MB), **arguments)


@pytest.mark.parametrize(("bandwidth", "latency"), [(0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (1.0, -0.1)])
def test_link_estimate_validates(bandwidth, latency):
    with pytest.raises(ValueError):
        LinkEstimate(bandwidth, latency)


@settings(max_examples=200, deadline=None)
@given(
    bandwidths=st.lists(st.floats(1e3, 1e10), min_size=2, max_size=6),
    latency=st.floats(0.0, 0.5),
    numel=st.integers(1, 2**26),
    target=st.floats(0.01, 10.0),
    is_gradient=st.booleans(),
)
def test_choice_is_monotone_in_bandwidth(bandwidths, latency, numel, target, is_gradient):
    """More bandwidth never means fewer bytes or a more aggressive codec."""
    choices = [choose_codec(link(b, latency), numel * 4, target, is_gradient) for b in sorted(bandwidths)]
    for slower, faster in zip(choices, choices[1:]):
        assert faster.estimated_nbytes >= slower.estimated_nbytes
        assert ORDER[faster.codec] <= ORDER[slower.codec]
        if slower.codec == faster.codec == "topk":
            assert faster.params["fraction"] >= slower.params["fraction"]


@settings(max_examples=100, deadline=None)
@given(
    bandwidth=st.floats(1e3, 1e10),
    latency=st.floats(0.0, 0.5),
    numel=st.integers(1, 2**26),
    target=st.floats(0.01, 10.0),
)
def test_a_choice_that_is_not_the_floor_fits_the_target(bandwidth, latency, numel, target):
    """Every choice but the top-k floor fits the slack (4x the target); latency is extra."""
    choice = choose_codec(link(bandwidth, latency), numel * 4, target, is_gradient=True)
    at_floor = choice.codec == "topk" and choice.params["fraction"] == MIN_TOPK_FRACTION_GRADIENT
    allowed = 4 * target
    if not at_floor:
        serialization_s = choice.estimated_nbytes / bandwidth
        assert serialization_s <= allowed * (1 + 1e-9) + 6 / bandwidth  # one value of rounding
        assert choice.estimated_transfer_s == pytest.approx(latency + serialization_s)


@pytest.mark.parametrize(
    ("name", "params"), [("none", {}), ("fp16", {}), ("int8", {}), ("int4", {}), ("topk", {"fraction": 0.013})]
)
@pytest.mark.parametrize("numel", [1, 4096, 1_500_000])
def test_size_estimates_match_what_the_codecs_send(name, params, numel):
    encoded = encode(torch.randn(numel), name, **params)
    assert estimated_nbytes(name, numel, 4, params.get("fraction", 1.0)) == encoded.nbytes


# ---------------------------------------------------------------- LinkBandwidthMeter


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_meter_defaults_until_measured_then_averages():
    clock = FakeClock()
    default = LinkEstimate(1 * MB, 0.05)
    meter = LinkBandwidthMeter(default=default, smoothing=0.5, clock=clock)
    assert meter.estimate("a->b") == default and meter.age_s("a->b") is None
    meter.record_transfer("a->b", 10 * MB, 1.0)  # 10 MB/s
    assert meter.estimate("a->b").bandwidth_bytes_per_s == pytest.approx(10 * MB)
    assert meter.estimate("a->b").latency_s == 0.05  # latency still the default
    meter.record_transfer("a->b", 10 * MB, 4.0)  # 2.5 MB/s; EMA of seconds per byte: (0.1 + 0.4) / 2
    assert meter.estimate("a->b").bandwidth_bytes_per_s == pytest.approx(MB / 0.25)
    clock.now += 7.0
    assert meter.age_s("a->b") == pytest.approx(7.0)
    assert meter.links() == ["a->b"]
    meter.forget("a->b")
    assert meter.estimate("a->b") == default


def test_meter_subtracts_the_measured_latency_but_credits_at_least_half_the_time():
    meter = LinkBandwidthMeter(default=LinkEstimate(MB, 0.0), smoothing=1.0, clock=FakeClock())
    meter.record_latency("l", 0.1)
    meter.record_transfer("l", MB, 0.6)  # 0.1 s latency + 0.5 s at 2 MB/s
    assert meter.estimate("l") == LinkEstimate(2 * MB, 0.1)
    meter.record_transfer("l", MB, 0.12)  # latency-dominated sample: counted as 0.06 s, not 0.02 s
    assert meter.estimate("l").bandwidth_bytes_per_s == pytest.approx(MB / 0.06)


def test_meter_measure_times_with_its_clock_and_skips_failed_transfers():
    clock = FakeClock()
    meter = LinkBandwidthMeter(default=LinkEstimate(MB, 0.0), smoothing=1.0, clock=clock)
    with meter.measure("l", 4 * MB):
        clock.now += 2.0
    assert meter.estimate("l").bandwidth_bytes_per_s == pytest.approx(2 * MB)
    with pytest.raises(RuntimeError):
        with meter.measure("l", 4 * MB):
            clock.now += 100.0
            raise RuntimeError("transfer failed")
    assert meter.estimate("l").bandwidth_bytes_per_s == pytest.approx(2 * MB)
    meter.record_transfer("l", 0, 1.0)  # empty transfers say nothing
    assert meter.estimate("l").bandwidth_bytes_per_s == pytest.approx(2 * MB)
    for bad in ((-1, 1.0), (10, float("nan")), (10, -1.0)):
        with pytest.raises(ValueError):
            meter.record_transfer("l", *bad)
    with pytest.raises(ValueError):
        LinkBandwidthMeter(default=LinkEstimate(MB, 0.0), smoothing=0.0)


def test_meter_feeds_choose_codec():
    clock = FakeClock()
    meter = LinkBandwidthMeter(default=LinkEstimate(1000 * MB, 0.001), clock=clock)
    assert choose_codec(meter.estimate("slow"), ACTIVATION_BYTES, 0.2, is_gradient=False).codec == "fp16"
    for _ in range(20):
        meter.record_transfer("slow", ACTIVATION_BYTES, ACTIVATION_BYTES / (0.25 * MB))  # 2 Mbit/s
    assert choose_codec(meter.estimate("slow"), ACTIVATION_BYTES, 0.2, is_gradient=False).codec == "topk"


# The loss budget: only codecs whose measured loss cost fits (synthetic costs here; the measured
# table is checked for what the trainer's default budget allows).
COSTS = {
    "activations": {"none": 0.0, "int8": 0.001, "int4": 0.03},
    "gradients": {"none": 0.0, "int8": 0.001, "int4": 0.005},
}


def test_a_budget_allows_the_codecs_whose_costs_add_up_within_it():
    assert codecs_within(0.0, COSTS) == {"activations": {"none"}, "gradients": {"none"}}
    assert codecs_within(0.002, COSTS) == {"activations": {"none", "int8"}, "gradients": {"none", "int8"}}
    # 1%: int4 fits on the gradients (0.5%) beside int8 on the activations, not on both
    assert codecs_within(0.01, COSTS) == {"activations": {"none", "int8"}, "gradients": {"none", "int8", "int4"}}
    # 3.1%: int4 on either side alone sends as few bytes; the cheaper split wins (0.6% against 3.1%)
    assert codecs_within(0.031, COSTS) == {"activations": {"none", "int8"}, "gradients": {"none", "int8", "int4"}}
    assert codecs_within(0.05, COSTS)["activations"] == {"none", "int8", "int4"}
    with pytest.raises(ValueError):
        codecs_within(-0.01, COSTS)


def test_a_codec_without_a_measured_cost_is_never_allowed():
    allowed = codecs_within(1.0)  # the measured table: top-k has no entry
    assert "topk" not in allowed["activations"] | allowed["gradients"]
    assert {"none", "int8", "int4"} <= allowed["activations"] & allowed["gradients"]


def test_the_default_budget_allows_int4_activations_and_int8_gradients():
    """2% (the trainer's default) on the measured costs: int4 on the activations (+0.9%) fits beside
    int8 on the gradients; int4 on the gradients (+3.2%) does not, not even alone."""
    allowed = codecs_within(0.02)
    assert allowed == {"activations": {"none", "fp16", "int8", "int4"}, "gradients": {"none", "fp16", "int8"}}
    assert codecs_within(0.005) == {"activations": {"none", "fp16", "int8"}, "gradients": {"none", "fp16", "int8"}}


def test_more_budget_never_sends_more_bytes():
    sent = []
    for budget in (0.0, 0.0001, 0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 1.0):
        allowed = codecs_within(budget)
        sent.append(sum(min(estimated_nbytes(c, 4096, 4) for c in codecs) for codecs in allowed.values()))
    assert sent == sorted(sent, reverse=True)


def test_under_a_budget_a_slow_link_keeps_the_strongest_allowed_codec_and_takes_longer():
    slow, target = link(0.25 * MB, 0.05), 0.2  # unbudgeted: top-k (see above)
    choice = choose_codec(slow, ACTIVATION_BYTES, target, is_gradient=True, allowed=frozenset({"none", "int8"}))
    assert choice.codec == "int8" and choice.estimated_transfer_s > 4 * target
    with_int4 = choose_codec(
        slow, ACTIVATION_BYTES, target, is_gradient=True, allowed=frozenset({"none", "int8", "int4"})
    )
    assert with_int4.codec == "int4"
    # a fast link chooses as without a budget
    fast = link(1000 * MB)
    assert (
        choose_codec(fast, ACTIVATION_BYTES, 10.0, is_gradient=False, allowed=frozenset({"none", "int8"})).codec
        == "none"
    )
    assert (
        choose_codec(fast, ACTIVATION_BYTES, 10.0, is_gradient=False, allowed=frozenset({"none", "fp16"})).codec
        == "fp16"
    )


def test_the_policy_applies_its_budget_and_a_call_may_carry_another():
    def on_a_slow_link(policy: CodecPolicy, **kwargs) -> str:
        policy.observe("peer", 1, nbytes=1_000_000, transfer_s=4.0, compute_s=0.1, batch_size=4)  # 0.25 MB/s
        return policy.choose("peer", 1, ACTIVATION_BYTES // 4, 4, is_gradient=True, **kwargs).codec

    assert on_a_slow_link(CodecPolicy("adaptive")) == "topk"  # no budget (inf): as before
    assert on_a_slow_link(CodecPolicy("adaptive", loss_budget=0.0)) == "none"
    assert on_a_slow_link(CodecPolicy("adaptive", loss_budget=0.001)) == "int8"
    assert on_a_slow_link(CodecPolicy("adaptive"), loss_budget=0.0) == "none"  # a chained call's budget
    assert CodecPolicy("int4", loss_budget=0.0).choose("peer", 1, 4096, 4, is_gradient=True).codec == "int4"
    with pytest.raises(ValueError):
        CodecPolicy("adaptive", loss_budget=-1.0)
