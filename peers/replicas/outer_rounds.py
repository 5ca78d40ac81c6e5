"""Outer rounds (DiLoCo, Streaming DiLoCo, DiLoCoX): replicas train on their own for H steps, then
exchange their pseudo-gradients, compressed, and take one outer step together. Pure: tensors in,
tensors out, no clock and no network; the peer and benchmarks/outer_in_process.py drive it alike.

A stage's trainable values are one flat buffer, cut into `fragments` equal contiguous slices. Each
fragment f keeps an anchor A (the parameters every replica agrees on), a base B (where this
replica's local progress is counted from), the outer momentum v and the rounds it took part in:
- a round of f begins after the steps `OuterSchedule.begins_after` names (every H steps, the
  fragments staggered by H / F): the pseudo-gradient d = B - x (x: the fragment's values now) is
  encoded with the row's codec plus this replica's error feedback (`PseudoGradientCoder`), and B := x;
- it is finished (`finish`) with every member's payload: the mean g of the decoded pseudo-gradients
  (every member decodes the same bytes and sums them in the senders' order, so all compute the same
  g, bit for bit; `robust_mean` in groups of three or more), the outer step A := A - lr (g + m v),
  v := m v + g (outer_step.py), then x := A + (x - B) and B := A;
- without overlap it is finished at once (x - B = 0: every replica holds A, DiLoCo); with overlap
  one round interval (H / F steps) later, while the replica computes on (x - B is what it learned
  meanwhile, kept, and counted in its next round), so the exchange hides behind that compute.
A round that fails (a member missing) changes nothing but the error feedback: what was encoded
goes back into the residual, and since B moved, the next round's d plus the residual covers both
periods: no local progress is lost. Error feedback (on by default for top-k) keeps what the codec
dropped and adds it to the next round's d; without it, a successful round forgets it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from peers.replicas.outer_step import OuterSettings, outer_update
from peers.replicas.robust_mean import robust_mean
from wire.compression import Codec, CodecError, EncodedTensor, ErrorFeedback, get_codec
from wire.compression import decode as decode_encoded

OUTER_CODECS = ("none", "fp16", "int8", "int4", "topk")


@dataclass(frozen=True)
class PseudoGradientCodec:
    """How a replica encodes its pseudo-gradients: a codec of the wire, top-k's fraction, and
    whether error feedback keeps what the codec dropped for the next round (default: top-k only)."""

    codec: str = "none"
    topk_fraction: float = 0.01
    error_feedback: bool | None = None  # None: on for top-k, off otherwise

    def __post_init__(self) -> None:
        if self.codec not in OUTER_CODECS:
            raise ValueError(f"unknown outer-round codec {self.codec!r}; use one of {', '.join(OUTER_CODECS)}")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError(f"the top-k fraction must lie in (0, 1], not {self.topk_fraction}")

    @property
    def feedback(self) -> bool:
        return self.codec == "topk" if self.error_feedback is None else self.error_feedback

    def make(self) -> Codec:
        return get_codec("topk", fraction=self.topk_fraction) if self.codec == "topk" else get_codec(self.codec)

    @property
    def label(self) -> str:
        name = "fp32" if self.codec == "none" else self.codec
        if self.codec == "topk":
            name = f"topk{self.topk_fraction:g}"
        if self.codec != "none" and self.feedback != (self.codec == "topk"):
            name += "+ef" if self.feedback else "-ef"
        return name


class PseudoGradientCoder:
    """One replica's encoder of its pseudo-gradients, with its own error feedback per fragment."""

    def __init__(self, codec: PseudoGradientCodec):
        self.settings = codec
        self.codec = codec.make()
        self.feedback = ErrorFeedback()

    def encode(self, fragment: int, delta: torch.Tensor) -> tuple[EncodedTensor, torch.Tensor]:
        """The payload of `delta` (plus what earlier rounds left unsent), and what it decodes to."""
        encoded = self.feedback.compress(fragment, delta, self.codec)
        return encoded, decode_encoded(encoded).float()

    def settle(self, fragment: int, sent: torch.Tensor, delivered: bool) -> None:
        """After the round: an undelivered payload goes back into the residual; a delivered one
        keeps the codec's error only with error feedback."""
        if not delivered:
            self.feedback.restore(fragment, sent)
        elif not self.settings.feedback:
            self.feedback.reset(fragment)


def decode_pseudo_gradient(encoded: EncodedTensor, numel: int) -> torch.Tensor:
    """A member's payload as float32 values; CodecError unless it is a floating 1-D tensor of `numel`."""
    header = encoded.header
    if header.shape != (numel,) or header.dtype != "float32":
        raise CodecError(f"a pseudo-gradient of {numel} float32 values was expected, got {header.shape} {header.dtype}")
    values = decode_encoded(encoded)
    if not bool(torch.isfinite(values).all()):
        raise CodecError("a pseudo-gradient holds non-finite values")
    return values


@dataclass(frozen=True)
class OuterSchedule:
    """When each fragment's round begins and when it is applied.

    every_steps = H: each fragment has a round every H local steps; fragment f's begin after the
    steps whose count is (f + 1) H / F modulo H (F = 1: every multiple of H). With `overlap` a round
    is applied H / F steps after it began (at the next fragment's round, or the same fragment's next
    with F = 1), else at once."""

    every_steps: int
    fragments: int = 1
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"outer rounds need every_steps >= 1, not {self.every_steps}")
        if self.fragments < 1 or self.every_steps % self.fragments:
            raise ValueError(
                f"{self.fragments} fragments cannot share rounds every {self.every_steps} steps evenly "
                "(every_steps must be a multiple of fragments)"
            )

    @property
    def interval(self) -> int:
        """Steps between two rounds of the stage (of any fragment)."""
        return self.every_steps // self.fragments

    @property
    def delay_steps(self) -> int:
        return self.interval if self.overlap else 0

    def begins_after(self, steps_done: int) -> list[int]:
        """The fragments whose round begins right after the local step that made `steps_done`."""
        if steps_done < 1 or steps_done % self.interval:
            return []
        return [(steps_done // self.interval - 1) % self.fragments]

    def applied_after(self, begun_after: int) -> int:
        """The step count after which a round begun after `begun_after` is applied."""
        return begun_after + self.delay_steps

    def describe(self) -> str:
        parts = [f"every {self.every_steps} steps"]
        if self.fragments > 1:
            parts.append(f"in {self.fragments} fragments")
        if self.overlap:
            parts.append(f"applied {self.delay_steps} steps late (overlapped)")
        return ", ".join(parts)


def fragment_bounds(num_values: int, fragments: int) -> list[tuple[int, int]]:
    """[start, stop) of each fragment: `fragments` contiguous slices of the flat buffer, equal to a value."""
    if fragments < 1 or fragments > max(num_values, 1):
        raise ValueError(f"cannot cut {num_values} values into {fragments} fragments")
    cuts = [round(i * num_values / fragments) for i in range(fragments + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass
class Contribution:
    """One member's payload in a round, as a receiver holds it (decoded once, however many read it)."""

    sender: str
    weight: float
    payload: EncodedTensor
    _decoded: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def values(self, numel: int) -> torch.Tensor:
        if self._decoded is None:
            self._decoded = decode_pseudo_gradient(self.payload, numel)
        elif self._decoded.numel() != numel:
            raise CodecError(f"a pseudo-gradient of {numel} values was expected, got {self._decoded.numel()}")
        return self._decoded


@dataclass
class BegunRound:
    """This replica's side of a round in flight: what it sent, for the error feedback to settle."""

    fragment: int
    begun_after: int  # the step count the round began after (its key, the same on every member)
    payload: EncodedTensor
    sent: torch.Tensor  # the payload decoded


def mean_pseudo_gradient(contributions: Sequence[Contribution], numel: int, robust: str = "none") -> torch.Tensor:
    """The group's outer gradient: every payload decoded, reduced in the senders' order (so every
    member computes the same values), robustly in groups of three or more (robust_mean.py)."""
    ordered = sorted(contributions, key=lambda c: c.sender)
    if len({c.sender for c in ordered}) != len(ordered):
        raise ValueError("a round holds two payloads of one sender")
    parts = [c.values(numel) for c in ordered]
    weights = [c.weight if math.isfinite(c.weight) and c.weight > 0 else 1e-9 for c in ordered]
    return robust_mean(parts, weights, robust).value


@dataclass
class FragmentState:
    anchor: torch.Tensor
    base: torch.Tensor
    velocity: torch.Tensor
    rounds_applied: int = 0
    in_flight: BegunRound | None = None


@dataclass
class OuterRounds:
    """One replica's outer rounds over a stage's flat buffer of values (module docstring)."""

    initial: torch.Tensor  # the flat values every replica starts from (the anchor)
    schedule: OuterSchedule
    settings: OuterSettings = field(default_factory=lambda: OuterSettings(lr=0.7, momentum=0.9))
    codec: PseudoGradientCodec = field(default_factory=PseudoGradientCodec)
    robust: str = "none"

    def __post_init__(self) -> None:
        flat = self.initial.detach().reshape(-1).float()
        self.bounds = fragment_bounds(flat.numel(), self.schedule.fragments)
        self.fragments = [
            FragmentState(flat[a:b].clone(), flat[a:b].clone(), torch.zeros(b - a)) for a, b in self.bounds
        ]
        self.coder = PseudoGradientCoder(self.codec)
        del self.initial  # the fragments hold their copies

    def view(self, flat: torch.Tensor, fragment: int) -> torch.Tensor:
        start, stop = self.bounds[fragment]
        return flat.reshape(-1)[start:stop]

    def begin(self, fragment: int, flat: torch.Tensor, begun_after: int) -> BegunRound:
        """Encode fragment `fragment`'s pseudo-gradient B - x (x: its values in `flat`), then B := x."""
        state = self.fragments[fragment]
        if state.in_flight is not None:
            begun = state.in_flight.begun_after
            raise RuntimeError(f"fragment {fragment} already has a round in flight (begun after step {begun})")
        values = self.view(flat, fragment).detach().float()
        payload, sent = self.coder.encode(fragment, state.base - values)
        state.base = values.clone()
        state.in_flight = BegunRound(fragment, begun_after, payload, sent)
        return state.in_flight

    def finish(self, fragment: int, flat: torch.Tensor, contributions: Sequence[Contribution] | None) -> bool:
        """End the round in flight of `fragment`: with every member's payload (this replica's among
        them), the outer step, and `flat`'s slice rebased onto the new anchor (in place); None (the
        round failed): nothing changes but the error feedback. Returns whether it was applied. A
        payload that does not decode raises CodecError and leaves the round in flight."""
        state = self.fragments[fragment]
        if state.in_flight is None:
            raise RuntimeError(f"fragment {fragment} has no round in flight")
        # decoded first: a payload that does not decode (CodecError) leaves the round in flight
        gradient = (
            None if contributions is None else mean_pseudo_gradient(contributions, state.anchor.numel(), self.robust)
        )
        begun, state.in_flight = state.in_flight, None
        if gradient is None:
            self.coder.settle(fragment, begun.sent, delivered=False)
            return False
        self.coder.settle(fragment, begun.sent, delivered=True)
        (state.anchor,) = outer_update([state.anchor], [gradient], [state.velocity], self.settings)
        values = self.view(flat, fragment)
        with torch.no_grad():
            learned_since = values.float() - state.base
            values.copy_(state.anchor + learned_since)
        state.base = state.anchor.clone()
        state.rounds_applied += 1
        return True

    def in_flight(self) -> list[BegunRound]:
        return [s.in_flight for s in self.fragments if s.in_flight is not None]

    def anchor_digest(self, fragment: int) -> str:
        """A short fingerprint of a fragment's anchor: replicas that agree hold the same."""
        return hashlib.sha256(self.fragments[fragment].anchor.numpy().tobytes()).hexdigest()[:16]
