"""Direct routing's per-hop codecs: which codec a peer sends its activations with to the next stage's
replica, and which it asks that replica to answer the gradient with.

A chained call carries the run's codec (`ChainRequest.codec`). A fixed codec applies on every hop.
With `adaptive`, the peer that sends a hop chooses for that hop's link with the same policy the
trainer uses for its links under hub routing (`wire.compression.policy.CodecPolicy`), from what this
peer measured of the link itself: each hop's bytes both ways and its time, less the time the replica
called spent in its handler (its compute and the stages after it), and that replica's compute. A
chain's hop carries two tensors (the activation forward, the gradient back) for one forward and one
backward of the replica called, so each tensor's share of that compute is half of it, as the hub's
per-call compute is for its one tensor. Unmeasured links go uncompressed until a hop was timed.

A peer that computes in 16 bits (`--precision bf16` or `fp16`) sends what it computed in 16 bits
where the caller or the run asks for no compression (`own_precision`): its values went through
16-bit arithmetic already, and "fp16" (scaled, ~5e-4 relative error per value, under bf16's own
rounding of ~4e-3) halves the bytes; decoded, the receiver gets float32 as before. A float32 peer
keeps "none", so the equality of a float32 swarm with one process is untouched.

Top-k's error feedback lives with the gradient's sender, the replica answering: its residuals are
keyed by `gradient_feedback_key` (the caller it answers), so what top-k dropped from one upstream
replica's gradients goes back to that replica on its next microbatch, never to another.

Pure: no I/O, no asyncio.
"""

from __future__ import annotations

import math

from wire.compression import CodecChoice
from wire.compression.policy import CodecPolicy, fixed_choice
from wire.protocol import ADAPTIVE

TENSORS_PER_HOP = 2  # the activation forward, its gradient back


SIXTEEN_BIT = ("bf16", "fp16")


def own_precision(codec: str, params: dict, precision: str) -> tuple[str, dict]:
    """The codec a peer computing in `precision` sends a tensor with, asked for `codec`: "fp16" in
    place of "none" when it computes in 16 bits, else what was asked."""
    if codec == "none" and precision in SIXTEEN_BIT:
        return "fp16", {}
    return codec, params


def gradient_feedback_key(caller: str) -> tuple[str, str]:
    """The error-feedback slot of the 'grad_inputs' a chained call answers to `caller`."""
    return "chain grad_inputs", caller


class HopCodecs:
    """This peer's codec choices for the hops it sends, and its measure of their links."""

    def __init__(self, *, transfer_budget: float = 0.5):
        self.adaptive = CodecPolicy(ADAPTIVE, transfer_budget=transfer_budget)

    def choose(
        self,
        mode: str,
        topk_fraction: float,
        peer_id: str,
        stage: int,
        numel: int,
        batch_size: int,
        *,
        is_gradient: bool,
        loss_budget: float = math.inf,
    ) -> CodecChoice:
        """The codec of one tensor on the hop to `peer_id` (a replica of `stage`): the run's fixed
        codec, or with `adaptive` the policy's choice for that link, within the run's loss budget."""
        if mode != ADAPTIVE:
            return fixed_choice(mode, topk_fraction)
        return self.adaptive.choose(peer_id, stage, numel, batch_size, is_gradient=is_gradient, loss_budget=loss_budget)

    def observe(
        self,
        peer_id: str,
        stage: int,
        *,
        nbytes: int,
        elapsed_s: float,
        handler_s: float,
        compute_s: float,
        batch_size: int,
    ) -> None:
        """Fold in one hop to `peer_id`: `nbytes` moved both ways, the call took `elapsed_s`, of which
        the replica called spent `handler_s` in its handler and `compute_s` computing (both as it
        answered)."""
        handler_s = min(max(handler_s, 0.0), elapsed_s)
        self.adaptive.observe(
            peer_id,
            stage,
            nbytes=nbytes,
            transfer_s=elapsed_s - handler_s,
            compute_s=max(compute_s, 0.0) / TENSORS_PER_HOP,
            batch_size=batch_size,
        )
