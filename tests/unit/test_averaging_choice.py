"""The averaging chosen from the link between a stage's replicas (peers/replicas/averaging_choice.py),
on synthetic links: exact sync on loopback and LAN, outer rounds on home links, within the loss budget."""

from __future__ import annotations

import pytest

from peers.config import ReplicaSettings
from peers.replicas.averaging_choice import (
    MEASURED_OUTER_COSTS,
    OuterOption,
    choose_averaging,
    outer_step_share,
    sync_round_s,
)
from process.config import ConfigError
from wire.compression import LinkEstimate

SMALL_STAGE = 2_467_584  # `small`, stage 0 of 2
OPTIONS = (
    OuterOption(every_steps=10, codec="none", bytes_per_value=4.0, loss_cost=-0.002),
    OuterOption(every_steps=100, codec="none", bytes_per_value=4.0, loss_cost=0.004),
    OuterOption(every_steps=100, codec="int8", bytes_per_value=1.0, loss_cost=0.006),
    OuterOption(every_steps=100, codec="int8", bytes_per_value=1.0, loss_cost=0.008, overlap=True),
    OuterOption(every_steps=100, codec="topk", bytes_per_value=0.06, loss_cost=0.03),
)
LOOPBACK = LinkEstimate(bandwidth_bytes_per_s=2e9, latency_s=1e-4)
LAN = LinkEstimate(bandwidth_bytes_per_s=1e9 / 8, latency_s=5e-4)
HOME = LinkEstimate(bandwidth_bytes_per_s=20e6 / 8, latency_s=0.05)  # 20 Mbit/s
SLOW = LinkEstimate(bandwidth_bytes_per_s=1e6 / 8, latency_s=0.15)  # 1 Mbit/s


def choose(link, step_s=1.0, **kwargs):
    return choose_averaging(num_values=SMALL_STAGE, group_size=2, step_s=step_s, link=link, options=OPTIONS, **kwargs)


@pytest.mark.parametrize("link", [LOOPBACK, LAN], ids=["loopback", "lan"])
def test_fast_links_keep_exact_sync(link):
    choice = choose(link)
    assert choice.mode == "sync" and choice.step_share <= 0.1, choice
    assert "exact sync" in choice.reason and "ms" in choice.reason
    # even for a stage whose step is too short for any link to carry its all-reduce in a tenth of it
    assert choose(link, step_s=1e-3).mode == "sync"


def test_a_link_short_of_fast_keeps_sync_only_when_the_step_hides_it():
    medium = LinkEstimate(bandwidth_bytes_per_s=200e6 / 8, latency_s=2e-3)  # 200 Mbit/s: ~0.8 s a small round
    assert choose(medium, step_s=10.0).mode == "sync"
    assert choose(medium, step_s=1.0).mode == "outer"


def test_a_home_link_takes_outer_rounds_the_cheapest_loss_that_fits():
    """At 20 Mbit/s sync needs ~4 s a 1 s step; fp32 every 10 steps is 40% of the steps between rounds,
    every 100 steps 4%: the latter fits, and of those that fit it has the lowest loss."""
    choice = choose(HOME)
    assert choice.mode == "outer" and choice.option == OPTIONS[1], choice
    assert choice.step_share <= 0.1 and "outer rounds every 100 steps, fp32" in choice.reason


def test_a_slower_link_takes_fewer_bytes_and_overlap():
    """At 1 Mbit/s an fp32 round takes 79 s and int8's 20 s: only the overlapped int8 round hides in the
    100 steps between rounds (100 s)."""
    choice = choose(SLOW)
    assert choice.option == OPTIONS[3], choice
    assert outer_step_share(OPTIONS[3], SMALL_STAGE, 2, SLOW, 1.0) == 0.0


def test_the_loss_budget_bounds_the_choice_and_a_link_too_slow_for_all_costs_time_not_loss():
    """Top-k would fit a 100 kbit/s link, but costs 3%: under the 1% budget the least slow setting
    within it is used, and the reason says that nothing fits; with a 5% budget top-k is chosen."""
    crawl = LinkEstimate(bandwidth_bytes_per_s=100e3 / 8, latency_s=0.3)
    within = choose(crawl)
    assert within.option == OPTIONS[3] and within.step_share > 0.1 and "no setting within the budget" in within.reason
    assert choose(crawl, loss_budget=0.05).option == OPTIONS[4]
    assert choose(HOME, loss_budget=-1.0).mode == "sync"  # nothing measured within it: exact sync stays


def test_without_a_measured_link_or_a_partner_the_choice_is_sync():
    assert choose(None).mode == "sync" and "no link" in choose(None).reason
    alone = choose_averaging(num_values=SMALL_STAGE, group_size=1, step_s=1.0, link=SLOW, options=OPTIONS)
    assert alone.mode == "sync" and "one replica" in alone.reason


def test_the_estimates_follow_the_link():
    assert sync_round_s(1_000_000, 2, LinkEstimate(bandwidth_bytes_per_s=4e6, latency_s=0.0)) == pytest.approx(1.0)
    assert sync_round_s(1_000_000, 4, LinkEstimate(bandwidth_bytes_per_s=4e6, latency_s=0.0)) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        choose(HOME, step_s=0.0)


def test_the_measured_settings_keep_sync_under_the_default_budget_and_a_wider_one_takes_outer_rounds():
    """The in-process table's rows (none within 1%): a home link keeps exact sync by default, slow as it
    is; with a 6% budget it takes the measured setting of least loss whose rounds fit a tenth of the
    steps, int4 every 10 steps; top-k and the overlapped fp32 round (+30%, +23%) need a budget past them."""
    home = choose_averaging(num_values=SMALL_STAGE, group_size=2, step_s=1.0, link=HOME)
    assert home.mode == "sync" and "no measured outer-round setting costs at most 1.0%" in home.reason
    wider = choose_averaging(num_values=SMALL_STAGE, group_size=2, step_s=1.0, link=HOME, loss_budget=0.06)
    assert wider.mode == "outer" and (wider.option.every_steps, wider.option.codec) == (10, "int4"), wider
    assert wider.step_share <= 0.1 and "+5.05% validation loss" in wider.reason
    assert all(o.loss_cost > 0.01 for o in MEASURED_OUTER_COSTS)
    assert len({o.label for o in MEASURED_OUTER_COSTS}) == len(MEASURED_OUTER_COSTS)  # each says what it is


def test_the_loss_budget_is_a_peer_option_checked_at_start():
    assert ReplicaSettings().averaging_loss_budget == 0.01
    assert ReplicaSettings(averaging_loss_budget=0.06).averaging_loss_budget == 0.06
    with pytest.raises(ConfigError, match="averaging-loss-budget"):
        ReplicaSettings(averaging_loss_budget=-0.01)
