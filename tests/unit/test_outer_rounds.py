"""Outer rounds (peers/replicas/outer_rounds.py): the pseudo-gradient codecs with error feedback,
the schedule of fragments and overlap, and the rounds' math against one-process references."""

from __future__ import annotations

import pytest
import torch

from peers.compute.stage_runtime import REPLICA_STATE_KEY
from peers.replicas.outer_averaging import agreed_state
from peers.replicas.outer_rounds import (
    Contribution,
    OuterRounds,
    OuterSchedule,
    PseudoGradientCodec,
    PseudoGradientCoder,
    fragment_bounds,
    mean_pseudo_gradient,
)
from peers.replicas.outer_step import OuterSettings
from swarm.export.assemble import agreed_part
from wire.compression import CodecError, relative_error_bound

PLAIN = OuterSettings(lr=1.0, momentum=0.0)  # the outer step that is the plain average


@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4", "topk"])
def test_each_codec_round_trips_a_pseudo_gradient_within_its_bound(codec):
    torch.manual_seed(0)
    delta = 1e-3 * torch.randn(50_000)
    coder = PseudoGradientCoder(PseudoGradientCodec(codec, topk_fraction=0.5, error_feedback=False))
    payload, sent = coder.encode(0, delta)
    assert sent.shape == delta.shape and sent.dtype == torch.float32
    error = float((sent - delta).norm() / delta.norm())
    bound = 0.75 if codec == "topk" else relative_error_bound(codec)  # top-k at 50% keeps most of the norm
    assert error <= bound, (codec, error)
    if codec == "none":
        assert torch.equal(sent, delta) and payload.nbytes == 4 * delta.numel()
    per_value = {"none": 4, "fp16": 2, "int8": 1.03, "int4": 0.54, "topk": 3.01}[codec]
    assert payload.nbytes <= per_value * delta.numel()


@pytest.mark.parametrize("codec, fraction", [("topk", 0.01), ("int4", 1.0), ("int8", 1.0)])
def test_error_feedback_sends_later_what_the_codec_dropped(codec, fraction):
    """With error feedback, what was sent plus the residual is the sum of the deltas: nothing is
    lost, only late; so the sent sum tracks the true sum, where without it the dropped parts add up."""
    torch.manual_seed(1)
    common = torch.randn(5_000)  # pseudo-gradients of successive rounds are alike: a common direction
    deltas = [common + 0.5 * torch.randn(5_000) for _ in range(200)]  # top-k at 1% needs 100 rounds to send all
    true_sum = torch.stack(deltas).sum(0)
    errors = {}
    for feedback in (True, False):
        coder = PseudoGradientCoder(PseudoGradientCodec(codec, topk_fraction=fraction, error_feedback=feedback))
        sent_sum = torch.zeros(5_000)
        for delta in deltas:
            _, sent = coder.encode(0, delta)
            coder.settle(0, sent, delivered=True)
            sent_sum += sent
        errors[feedback] = float((true_sum - sent_sum).norm())
        if feedback:  # the residual is exactly what is still owed
            assert abs(coder.feedback.residual_norm(0) - errors[True]) <= 1e-4 * float(true_sum.norm())
    assert errors[True] < 0.5 * errors[False], errors


def test_without_error_feedback_a_delivered_round_forgets_what_the_codec_dropped():
    coder = PseudoGradientCoder(PseudoGradientCodec("topk", topk_fraction=0.1, error_feedback=False))
    _, sent = coder.encode(0, torch.randn(1000))
    coder.settle(0, sent, delivered=True)
    assert coder.feedback.residual_norm(0) == 0.0
    assert PseudoGradientCodec("topk").feedback and not PseudoGradientCodec("int8").feedback


def test_an_undelivered_payload_is_sent_with_the_next_round():
    """A round that failed: what was encoded goes back to the residual, with or without error feedback."""
    for feedback in (False, True):
        coder = PseudoGradientCoder(PseudoGradientCodec("none", error_feedback=feedback))
        first, second = torch.randn(100), torch.randn(100)
        _, sent = coder.encode(0, first)
        coder.settle(0, sent, delivered=False)
        _, sent = coder.encode(0, second)
        torch.testing.assert_close(sent, first + second, atol=1e-6, rtol=0)


def test_a_payload_of_the_wrong_size_or_values_is_refused():
    coder = PseudoGradientCoder(PseudoGradientCodec("none"))
    payload, _ = coder.encode(0, torch.randn(10))
    with pytest.raises(CodecError):
        mean_pseudo_gradient([Contribution("a", 1.0, payload)], 11)
    bad, sent = PseudoGradientCoder(PseudoGradientCodec("fp16")).encode(0, torch.tensor([1.0, float("nan")]))
    assert not bool(torch.isfinite(sent).all())  # a replica's own payload is not checked; its groupmates check it
    with pytest.raises(CodecError):
        mean_pseudo_gradient([Contribution("a", 1.0, bad)], 2)


def test_the_schedule_staggers_fragments_and_delays_overlapped_rounds():
    plain = OuterSchedule(every_steps=10)
    assert [s for s in range(1, 31) if plain.begins_after(s)] == [10, 20, 30]
    assert plain.delay_steps == 0 and plain.applied_after(10) == 10
    staggered = OuterSchedule(every_steps=10, fragments=2, overlap=True)
    assert {s: staggered.begins_after(s) for s in range(1, 21) if staggered.begins_after(s)} == {
        5: [0],
        10: [1],
        15: [0],
        20: [1],
    }
    assert staggered.interval == 5 and staggered.applied_after(5) == 10
    with pytest.raises(ValueError):
        OuterSchedule(every_steps=10, fragments=3)
    assert fragment_bounds(10, 3) == [(0, 3), (3, 7), (7, 10)]


def toy_progress(replica: int, step: int, numel: int) -> torch.Tensor:
    """What a replica's local step adds to its values (deterministic, different per replica)."""
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return 0.01 * torch.randn(numel, generator=generator) + 0.003 * (replica - 0.5)


def run_rounds(schedule, settings, codec, steps, numel=64, replicas=2, fail_after=()):
    """Replicas that step on toy progress and meet on `schedule`; returns their values and states."""
    initial = torch.linspace(-1, 1, numel)
    states = [OuterRounds(initial, schedule, settings, codec) for _ in range(replicas)]
    values = [initial.clone() for _ in range(replicas)]
    for step in range(1, steps + 1):
        for r in range(replicas):
            values[r] += toy_progress(r, step, numel)
        for fragment in range(schedule.fragments):  # overlapped rounds due now are applied first
            begun = states[0].fragments[fragment].in_flight
            if begun is not None and schedule.applied_after(begun.begun_after) == step:
                finish_everywhere(states, values, fragment, failed=begun.begun_after in fail_after)
        for fragment in schedule.begins_after(step):
            for state, v in zip(states, values):
                state.begin(fragment, v, step)
            if not schedule.overlap:
                finish_everywhere(states, values, fragment, failed=step in fail_after)
    return values, states


def finish_everywhere(states, values, fragment, failed=False):
    contributions = None
    if not failed:
        contributions = [
            Contribution(f"replica{r}", 1.0, s.fragments[fragment].in_flight.payload) for r, s in enumerate(states)
        ]
    for state, v in zip(states, values):
        state.finish(fragment, v, contributions)


def test_rounds_without_overlap_are_diloco():
    """Every H steps the replicas' pseudo-gradients A - x are averaged and the anchor takes an SGD
    Nesterov step on them (torch's, as reference); every replica then holds the anchor, bit for bit."""
    settings = OuterSettings(lr=0.7, momentum=0.9)
    values, states = run_rounds(OuterSchedule(every_steps=5), settings, PseudoGradientCodec("none"), steps=15)
    reference = torch.linspace(-1, 1, 64).requires_grad_(True)
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    local = [reference.detach().clone() for _ in range(2)]
    for step in range(1, 16):
        for r in range(2):
            local[r] += toy_progress(r, step, 64)
        if step % 5 == 0:
            reference.grad = sum(reference.detach() - x for x in local) / 2
            sgd.step()
            local = [reference.detach().clone() for _ in range(2)]
    assert torch.equal(values[0], values[1])
    torch.testing.assert_close(values[0], reference.detach(), atol=1e-6, rtol=0)
    assert states[0].anchor_digest(0) == states[1].anchor_digest(0)
    assert states[0].fragments[0].rounds_applied == 3


def overlapped_reference(steps: int, every: int, settings: OuterSettings, numel: int = 64):
    """One process, written out plainly: the pseudo-gradient of period p (each replica's progress in
    it) is averaged and stepped on at the end of period p + 1; each replica then computes on the new
    anchor plus what it learned in period p + 1."""
    anchor, velocity = torch.linspace(-1, 1, numel), torch.zeros(numel)
    learned = [torch.zeros(numel), torch.zeros(numel)]  # progress since the period began
    pending = None  # the mean pseudo-gradient of the period before
    values = None
    for step in range(1, steps + 1):
        for r in range(2):
            learned[r] += toy_progress(r, step, numel)
        if step % every == 0:
            if pending is not None:
                velocity = settings.momentum * velocity + pending
                anchor = anchor - settings.lr * (pending + settings.momentum * velocity)
            pending = -(learned[0] + learned[1]) / 2
            # each replica computes on: anchor + its progress of this period (not yet sent)
            values = [anchor + learned[r] for r in range(2)]
            learned = [torch.zeros(numel), torch.zeros(numel)]
    return values, anchor


@pytest.mark.parametrize("settings", [PLAIN, OuterSettings(lr=0.7, momentum=0.9)], ids=["plain", "nesterov"])
def test_an_overlapped_round_equals_a_one_process_reference(settings):
    steps, every = 20, 5  # ends right after a round began: its predecessor just applied
    values, states = run_rounds(OuterSchedule(every_steps=every, overlap=True), settings, PseudoGradientCodec(), steps)
    ref_values, ref_anchor = overlapped_reference(steps, every, settings)
    for ours, theirs in zip(values, ref_values):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(states[0].fragments[0].anchor, ref_anchor, atol=1e-6, rtol=0)
    exact, _ = run_rounds(OuterSchedule(every_steps=every), settings, PseudoGradientCodec(), steps)
    assert float((exact[0] - values[0]).abs().max()) > 1e-3  # the delay shows: the test tells them apart


def test_fragments_are_rounds_of_their_own_slices():
    """Two fragments, staggered, overlapped: each slice follows its own schedule, and the replicas'
    anchors agree fragment by fragment."""
    schedule = OuterSchedule(every_steps=10, fragments=2, overlap=True)
    values, states = run_rounds(schedule, PLAIN, PseudoGradientCodec("int8"), steps=30)
    for fragment in range(2):
        assert states[0].anchor_digest(fragment) == states[1].anchor_digest(fragment)
        assert states[0].fragments[fragment].rounds_applied == (3 if fragment == 0 else 2)


def test_a_failed_round_loses_no_progress():
    """The first round fails everywhere: the second carries both periods' progress, so (plain
    average, lossless) the anchor after it is the mean of the replicas' values, as without a failure."""
    values, states = run_rounds(OuterSchedule(every_steps=5), PLAIN, PseudoGradientCodec("none"), 10, fail_after={5})
    assert states[0].fragments[0].rounds_applied == 1
    local = [torch.linspace(-1, 1, 64) for _ in range(2)]
    for step in range(1, 11):
        for r in range(2):
            local[r] += toy_progress(r, step, 64)
    torch.testing.assert_close(values[0], (local[0] + local[1]) / 2, atol=1e-6, rtol=0)


def test_compressed_replicas_agree_bit_for_bit_after_each_round():
    for codec in (PseudoGradientCodec("int4"), PseudoGradientCodec("topk", topk_fraction=0.05)):
        values, states = run_rounds(OuterSchedule(every_steps=4), OuterSettings(), codec, steps=12, numel=5000)
        assert torch.equal(values[0], values[1]), codec
        assert states[0].anchor_digest(0) == states[1].anchor_digest(0)


def test_robust_rounds_bound_a_lying_member():
    torch.manual_seed(2)
    coder = PseudoGradientCoder(PseudoGradientCodec("none"))
    honest = [torch.randn(1000) * 0.01 + 0.1 for _ in range(3)]
    liar = -1000 * honest[0]
    contributions = [Contribution(f"r{i}", 1.0, coder.encode(i, d)[0]) for i, d in enumerate([*honest, liar])]
    plain = mean_pseudo_gradient(contributions, 1000, "none")
    robust = mean_pseudo_gradient(contributions, 1000, "clip")
    honest_mean = torch.stack(honest).mean(0)
    assert float((robust - honest_mean).norm()) < 0.1 * float((plain - honest_mean).norm())


def test_an_export_takes_an_outer_replicas_anchor_and_says_after_which_round():
    module_state = {"w": torch.ones(2, 3), "b": torch.ones(3), "mask": torch.zeros(4)}  # mask: a buffer
    anchors = [torch.arange(5.0), torch.arange(5.0, 9.0)]  # two fragments of the 9 trainable values
    optimizer_state = {
        "state": {},
        REPLICA_STATE_KEY: {"names": ["w", "b"], "anchors": anchors, "rounds_applied": [3, 2]},
    }
    state, rounds = agreed_state(module_state, optimizer_state)
    assert rounds == 5 and torch.equal(state["w"], torch.arange(6.0).view(2, 3))
    assert torch.equal(state["b"], torch.arange(6.0, 9.0)) and torch.equal(state["mask"], module_state["mask"])
    assert (
        agreed_part(module_state, optimizer_state, "replica …x")[1]
        == "replica …x (the anchor of its outer rounds, after 5)"
    )
    assert agreed_state(module_state, {"state": {}}) is None  # another mode's state: its own tensors
