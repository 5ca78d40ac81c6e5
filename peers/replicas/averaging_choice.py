"""Which agreement a stage's replicas use, from the link between them (`--averaging auto`): exact
sync where the link carries a step's all-reduce in a small share of the step, outer rounds where it
does not. Pure: a link estimate, the stage's size and step time in, a choice with its reason out.

The rule, for a stage of `num_values` float32 values, `group_size` replicas, a step of `step_s`
seconds of compute, a link of bandwidth B and one-way latency L, and a loss budget:
1. exact sync, if its all-reduce (2 (n - 1) / n x 4 x num_values bytes each way, 2 (n - 1) latencies)
   takes at most `sync_share` (10%) of a step, or the link carries at least `FAST_LINK_BYTES_PER_S`
   (400 Mbit/s: loopback and LAN, as the link probe measures them through p2pd; home links carry
   10-100): the swarm then stays the one-process update, and on such links a round's cost is CPU,
   which exact sync over gloo or by exchange keeps near the wire's (gloo_allreduce.py, sync_exchange.py);
2. otherwise outer rounds: among the settings whose measured validation-loss cost against exact sync
   (`MEASURED_OUTER_COSTS`, benchmarks/RESULTS.md) fits the budget, the one whose rounds cost the step
   the least time, ties to the lower loss cost, then to fewer bytes. A round of one fragment sends
   (n - 1) x its payload; without overlap the commit waits for it (it costs its whole time, spread
   over the steps between rounds); overlapped, only what does not fit in those steps' compute;
3. where no setting's rounds fit `sync_share` either, the one that costs the least time: a slow
   link then costs time, never more loss than the budget; with no setting within the budget, sync.
Without a measured link (a replica alone in its stage, nobody to probe) the choice is sync: it is
exact, and a link that turns out slow shows as rounds that take long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wire.compression import LinkEstimate

# how exact sync's rounds travel (`--averaging-transport`): auto is gloo where it may be used (no run
# authority, an announced address), else by exchange; hivemind: its averager, always
AVERAGING_TRANSPORTS = ("auto", "exchange", "gloo", "hivemind")
DEFAULT_SYNC_SHARE = 0.1  # of a step that exact sync's all-reduce may take
FAST_LINK_BYTES_PER_S = 400e6 / 8  # a link at least this fast keeps exact sync whatever the step
DEFAULT_LOSS_BUDGET = 0.01  # validation loss against exact sync: 1%


@dataclass(frozen=True)
class OuterOption:
    """One outer-rounds setting and its measured cost: validation loss against exact sync at equal
    tokens (0.01 = 1% worse; `small`, 2 replicas per stage, 2M tokens, benchmarks/outer_in_process.py)."""

    every_steps: int
    codec: str
    bytes_per_value: float  # payload bytes per float32 value of the codec
    loss_cost: float
    overlap: bool = False
    fragments: int = 1
    topk_fraction: float = 0.01
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @property
    def label(self) -> str:
        codec = f"topk {self.topk_fraction:g}" if self.codec == "topk" else self.codec
        extra = (", overlapped" if self.overlap else "") + (
            f", {self.fragments} fragments" if self.fragments > 1 else ""
        )
        return f"outer rounds every {self.every_steps} steps, {codec}{extra}"


# Filled from the in-process table (benchmarks/RESULTS.md, "Outer rounds: the in-process convergence
# table"); a setting that was not measured is not here, so it is never chosen.
MEASURED_OUTER_COSTS: tuple[OuterOption, ...] = ()


@dataclass(frozen=True)
class AveragingChoice:
    mode: str  # "sync" or "outer"
    reason: str
    option: OuterOption | None = None  # outer: the setting
    round_s: float = 0.0  # estimated seconds of one round (sync: the all-reduce)
    step_share: float = 0.0  # estimated share of a step the agreement costs


def sync_round_s(num_values: int, group_size: int, link: LinkEstimate) -> float:
    if group_size < 2:
        return 0.0
    nbytes = 2 * (group_size - 1) / group_size * 4 * num_values
    return 2 * (group_size - 1) * link.latency_s + nbytes / link.bandwidth_bytes_per_s


def outer_round_s(option: OuterOption, num_values: int, group_size: int, link: LinkEstimate) -> float:
    """One fragment's round: (n - 1) payloads out (and as many in, on the other direction)."""
    nbytes = (group_size - 1) * option.bytes_per_value * num_values / option.fragments
    return link.latency_s + nbytes / link.bandwidth_bytes_per_s


def outer_step_share(option: OuterOption, num_values: int, group_size: int, link: LinkEstimate, step_s: float) -> float:
    """The share of a step's time the rounds add: each fragment's round comes every H / F steps."""
    window = option.every_steps / option.fragments * step_s
    round_s = outer_round_s(option, num_values, group_size, link)
    waited = max(round_s - window, 0.0) if option.overlap else round_s
    return waited / window


def choose_averaging(
    *,
    num_values: int,
    group_size: int,
    step_s: float,
    link: LinkEstimate | None,
    loss_budget: float = DEFAULT_LOSS_BUDGET,
    sync_share: float = DEFAULT_SYNC_SHARE,
    options: tuple[OuterOption, ...] = MEASURED_OUTER_COSTS,
) -> AveragingChoice:
    if num_values < 1 or step_s <= 0 or not math.isfinite(step_s):
        raise ValueError(f"a stage of {num_values} values and a step of {step_s} s cannot be averaged")
    if link is None or group_size < 2:
        why = "no link to another replica is measured" if link is None else "the stage has one replica"
        return AveragingChoice("sync", f"exact sync: {why}")
    sync_s = sync_round_s(num_values, group_size, link)
    if link.bandwidth_bytes_per_s >= FAST_LINK_BYTES_PER_S:
        return AveragingChoice(
            "sync",
            f"exact sync: a fast link ({link.bandwidth_bytes_per_s * 8 / 1e6:,.0f} Mbit/s; its all-reduce takes "
            f"~{sync_s * 1e3:.0f} ms)",
            round_s=sync_s,
            step_share=sync_s / step_s,
        )
    if sync_s <= sync_share * step_s:
        return AveragingChoice(
            "sync",
            f"exact sync: its all-reduce takes ~{sync_s * 1e3:.0f} ms, {sync_s / step_s:.0%} of a {step_s:.2f} s step "
            f"(at most {sync_share:.0%})",
            round_s=sync_s,
            step_share=sync_s / step_s,
        )
    within = [o for o in options if o.loss_cost <= loss_budget]
    if not within:
        return AveragingChoice(
            "sync",
            f"exact sync, although its all-reduce takes ~{sync_s * 1e3:.0f} ms, {sync_s / step_s:.0%} of a {step_s:.2f} s "
            f"step: no measured outer-round "
            f"setting costs at most {loss_budget:.1%} of validation loss",
            round_s=sync_s,
            step_share=sync_s / step_s,
        )

    def cost(o: OuterOption) -> tuple:
        share = outer_step_share(o, num_values, group_size, link, step_s)
        return (sync_share if share <= sync_share else share, o.loss_cost, o.bytes_per_value / o.every_steps)

    best = min(within, key=cost)
    share = outer_step_share(best, num_values, group_size, link, step_s)
    fits = "" if share <= sync_share else f"; no setting within the budget fits {sync_share:.0%}, this one costs least"
    return AveragingChoice(
        "outer",
        f"{best.label}: exact sync's all-reduce would take ~{sync_s:.1f} s of a {step_s:.2f} s step; a round takes "
        f"~{outer_round_s(best, num_values, group_size, link):.2f} s, {share:.0%} of the steps between rounds, "
        f"at {best.loss_cost:+.2%} validation loss{fits}",
        option=best,
        round_s=outer_round_s(best, num_values, group_size, link),
        step_share=share,
    )
