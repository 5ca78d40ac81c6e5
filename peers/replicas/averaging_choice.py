"""Which agreement a stage's replicas use, from the link between them (`--averaging auto`): exact
sync where the link carries a step's all-reduce in a small share of the step, outer rounds where it
does not. Pure: a link estimate, the stage's size and step time in, a choice with its reason out.

The rule, for a stage of `num_values` float32 values, `group_size` replicas, a step of `step_s`
seconds of compute, a link of bandwidth B and one-way latency L, and a loss budget (the peer's
`--averaging-loss-budget`, 1% by default):
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
DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM = 0.7, 0.9  # the DiLoCo outer step the table measured


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
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM

    @property
    def label(self) -> str:
        codec = {"topk": f"topk {self.topk_fraction:g}", "none": "fp32"}.get(self.codec, self.codec)
        extra = (", overlapped" if self.overlap else "") + (
            f", {self.fragments} fragments" if self.fragments > 1 else ""
        )
        if (self.outer_lr, self.outer_momentum) != (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM):
            extra += f", outer lr {self.outer_lr:g} momentum {self.outer_momentum:g}"
        return f"outer rounds every {self.every_steps} steps, {codec}{extra}"


# The in-process table's rows (benchmarks/RESULTS.md, "Outer rounds: the in-process convergence
# table": `small`, 2 stages x 2 replicas, 2M tokens, one seed); a setting that was not measured is not
# here, so it is never chosen. None costs 1% or less: under the default budget the choice is sync.
_INT8_BYTES = 1.0 + 4.0 / 4096  # a byte a value and a float32 scale per block of 4096 (the payload's)
_INT4_BYTES = 63.59 / 119.97 * _INT8_BYTES  # the table's int4 payload against its int8 payload
MEASURED_OUTER_COSTS: tuple[OuterOption, ...] = (
    OuterOption(every_steps=10, codec="none", bytes_per_value=4.0, loss_cost=0.0510),
    OuterOption(every_steps=50, codec="none", bytes_per_value=4.0, loss_cost=0.0816),
    OuterOption(every_steps=10, codec="int8", bytes_per_value=_INT8_BYTES, loss_cost=0.0516),
    OuterOption(every_steps=10, codec="int4", bytes_per_value=_INT4_BYTES, loss_cost=0.0505),
    OuterOption(every_steps=10, codec="topk", bytes_per_value=7.18 / 478.8 * 4.0, loss_cost=0.2963),
    OuterOption(every_steps=10, codec="none", bytes_per_value=4.0, loss_cost=0.2317, overlap=True),
    OuterOption(every_steps=10, codec="none", bytes_per_value=4.0, loss_cost=0.0614, outer_lr=1.0, outer_momentum=0.0),
)


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
