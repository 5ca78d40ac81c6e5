"""Which codec each tensor crossing a link uses: one fixed codec for every link, or `adaptive`,
chosen per link and per tensor. The trainer keeps one for its links to the peers (hub routing,
swarm/trainer/stage_call.py); with direct routing every peer keeps one for its hops to the next
stage's replicas (peers/serving/chain_rpc.py), so each hop's codec is chosen by its sender.

The adaptive rule (the choice itself is `wire.compression.adaptive.choose_codec`):

- target: putting a tensor on the wire should take at most `transfer_budget` (0.5) times the
  compute the stage spends on the same microbatch (an EMA of the compute seconds per sample the
  peer reports), so that the link, not the compute, is never the pipeline's bottleneck;
- link: bandwidth from the measured calls (payload bytes over the call time minus the peer's
  compute and queueing, less the link's latency, taken as 0.9x the cheapest call seen);
- choice: the first of none, fp16, int8 whose serialization time (bytes / bandwidth; latency is
  not counted, no codec shortens it) fits the target; int8 also when it takes up to
  `topk_slack` (4) times the target; on slower links int4 (~half int8's bytes, every value kept
  at ~0.11 relative error) when it fits `topk_slack` times the target; top-k only on links
  slower than that, with the fraction that fills `topk_slack` times the target (gradients with
  error feedback, floor 0.1%; activations floor 5%). Before the stage's compute is measured,
  calls go uncompressed;
- loss budget (`loss_budget`, the trainer's `--codec-loss-budget`): only the codecs whose measured
  validation-loss cost, activations' and gradients' added, fits it (`codecs_within`); where none of
  them fits a link's target the most compressed of them is used, so a slow link costs time, never
  more loss than the budget. `inf`: no budget (top-k, whose cost is not measured, allowed).
"""

from __future__ import annotations

import functools
import math

from wire.compression.adaptive import CodecChoice, LinkBandwidthMeter, LinkEstimate, choose_codec, codecs_within
from wire.compression.codecs import BlockwiseInt8Codec
from wire.compression.registry import known_codecs

CODEC_MODES = [*known_codecs(), "adaptive"]


class CodecPolicy:
    def __init__(
        self,
        mode: str = "none",
        *,
        topk_fraction: float = 0.1,
        transfer_budget: float = 0.5,
        meter: LinkBandwidthMeter | None = None,
        loss_budget: float = math.inf,
    ):
        if mode not in CODEC_MODES:
            raise ValueError(f"unknown codec {mode!r}; choose one of {', '.join(CODEC_MODES)}")
        self.mode, self.topk_fraction, self.transfer_budget = mode, topk_fraction, transfer_budget
        allowed_codecs(loss_budget, False)  # a bad budget fails here, not at the first call
        self.loss_budget = loss_budget
        # An unmeasured link is assumed fast (1 GB/s): first calls go uncompressed, then adapt.
        self.meter = meter or LinkBandwidthMeter(default=LinkEstimate(bandwidth_bytes_per_s=1e9, latency_s=1e-3))
        self.compute_s: dict[int, float] = {}  # EMA of compute seconds per sample, per stage
        self._fixed_cost_s: dict[str, float] = {}  # per link: the cheapest call seen, taken as its latency

    def warm_up(self) -> None:
        """Load bitsandbytes' kernels now if this policy may pick int8 (the first call in a
        process takes seconds, more on a busy machine), so that no timed call pays for it."""
        if self.mode in ("int8", "adaptive"):
            BlockwiseInt8Codec.warm_up()

    def choose(
        self,
        peer_id: str,
        stage: int,
        numel: int,
        batch_size: int,
        *,
        is_gradient: bool,
        loss_budget: float | None = None,
    ) -> CodecChoice:
        """The codec of one tensor to `peer_id` (a replica of `stage`); `loss_budget` overrides the
        policy's own (a chained call carries its trainer's)."""
        if self.mode != "adaptive":
            return fixed_choice(self.mode, self.topk_fraction)
        per_sample = self.compute_s.get(stage)
        if per_sample is None:  # nothing measured yet
            return CodecChoice("none", {})
        target_s = max(per_sample * batch_size * self.transfer_budget, 1e-4)
        allowed = allowed_codecs(self.loss_budget if loss_budget is None else loss_budget, is_gradient)
        return choose_codec(self.meter.estimate(peer_id), numel * 4, target_s, is_gradient, allowed=allowed)

    def observe(
        self, peer_id: str, stage: int, *, nbytes: int, transfer_s: float, compute_s: float, batch_size: int
    ) -> None:
        """Fold in one call: `nbytes` moved both ways in `transfer_s` (elapsed minus compute and queue)."""
        if transfer_s > 0 and nbytes > 0:
            # Without a latency estimate, small (compressed) messages would look like a slow link
            # and push compression ever harder; the cheapest call seen bounds the fixed cost.
            fixed = min(self._fixed_cost_s.get(peer_id, transfer_s), transfer_s)
            self._fixed_cost_s[peer_id] = fixed
            self.meter.record_latency(peer_id, 0.9 * fixed)
            self.meter.record_transfer(peer_id, nbytes, transfer_s)
        if compute_s > 0:
            sample = compute_s / batch_size
            old = self.compute_s.get(stage)
            self.compute_s[stage] = sample if old is None else 0.9 * old + 0.1 * sample


def fixed_choice(codec: str, topk_fraction: float = 0.1) -> CodecChoice:
    """The choice of a fixed codec (`topk` keeps `topk_fraction` of the values)."""
    return CodecChoice(codec, {"fraction": topk_fraction} if codec == "topk" else {})


@functools.lru_cache(maxsize=64)
def allowed_codecs(loss_budget: float, is_gradient: bool) -> frozenset[str] | None:
    """What a loss budget lets one direction use (None: anything, for an infinite budget)."""
    if math.isinf(loss_budget) and loss_budget > 0:
        return None
    return codecs_within(loss_budget)["gradients" if is_gradient else "activations"]
