"""The penalty box that rate-limits callers who keep sending bad requests, on a fake clock."""

from __future__ import annotations

import pytest

from wire.request_limits import PenaltyBox, RequestTooLargeError, check_request_bytes


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_caller_is_limited_after_its_burst_and_allowed_again_after_refill():
    clock = Clock()
    box = PenaltyBox(burst=3, refill_per_s=0.5, clock=clock)
    for _ in range(3):
        assert box.allows("bad")
        box.penalize("bad")
    assert not box.allows("bad") and box.refused == 1
    assert box.limited() == ["bad"]
    assert box.seconds_until_allowed("bad") == pytest.approx(2.0)
    clock.now_s = 1.9
    assert not box.allows("bad")
    clock.now_s = 2.0
    assert box.allows("bad")
    box.penalize("bad")
    assert not box.allows("bad")  # one refilled token, spent again
    assert box.refused == 3


def test_good_callers_are_never_limited_and_callers_are_independent():
    clock = Clock()
    box = PenaltyBox(burst=1, refill_per_s=0.1, clock=clock)
    box.penalize("bad")
    assert not box.allows("bad")
    for _ in range(1000):
        assert box.allows("good")
    clock.now_s = 1e6  # refill is capped at the burst
    assert box.allows("bad")
    box.penalize("bad")
    assert not box.allows("bad")


def test_memory_stays_bounded_under_made_up_caller_ids():
    box = PenaltyBox(burst=1, max_callers=100, clock=Clock())
    for i in range(10_000):
        box.penalize(f"sybil-{i}")
    assert len(box._buckets) == 100
    assert box.limited() == sorted(f"sybil-{i}" for i in range(9_900, 10_000))


@pytest.mark.parametrize(
    "kwargs", [dict(burst=0), dict(refill_per_s=0.0), dict(refill_per_s=float("inf")), dict(max_callers=0)]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PenaltyBox(**kwargs)


def test_request_size_limit():
    check_request_bytes(100, 100)
    with pytest.raises(RequestTooLargeError, match="more than 100 bytes"):
        check_request_bytes(101, 100)
