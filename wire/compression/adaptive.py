"""Link-adaptive codec choice: our own design of FusionLLM's AdaTopK idea.

`choose_codec` picks the codec for one tensor of ``tensor_nbytes`` bytes on a link of estimated
bandwidth ``B``, given a target time ``T`` to put it on the wire (``wire.compression.policy``
derives it from the receiving stage's compute):

1. among "none", "fp16" and "int8", the least estimated time ``cpu(c) * numel + bytes(c) / B``
   (ties: the less lossy), among those within ``topk_slack * T``;
2. on a slower link, "int4" if it fits ``topk_slack * T``;
3. only on a very slow link, "topk" with the fraction that fills the budget, no lower than
   ``min_fraction`` (0.1% for gradients, which have error feedback; 5% for activations).

The rule is monotone: more bandwidth or a longer target never yields fewer bytes.
``LinkBandwidthMeter`` turns measured transfers into ``LinkEstimate``s. A loss budget
(``allowed``, from ``codecs_within`` and ``MEASURED_LOSS_COSTS``) bounds the choice: where no
allowed codec fits the target, the most compressed of them is used, so a slow link costs time,
never loss; codecs without a measurement (top-k) are never chosen under a budget.

The thresholds and the measurements behind them: docs/design/wire.md.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from wire.compression.base import DEFAULT_MAX_PART_BYTES
from wire.compression.codecs import index_dtype_for, topk_count
from wire.compression.int4 import int4_nbytes
from wire.compression.parts import int8_elements_per_part, int8_nbytes

MIN_TOPK_FRACTION_GRADIENT = 0.001
MIN_TOPK_FRACTION_ACTIVATION = 0.05
# Encode + decode seconds per value, one CPU thread, 131k-value float32 tensors; measured on the
# shared 2-core development machine under load (best of 5 x 20): none 0.8 ns, fp16 1.2 ns, int8 18.8 ns.
# int4, measured later at a lower load (none 0.7, fp16 1.2, int8 12.2, int4 8.8 ns), scaled by int8's
# ratio to the same conditions: 13.5 ns.
CODEC_CPU_S_PER_VALUE = {"none": 0.8e-9, "fp16": 1.2e-9, "int8": 18.8e-9, "int4": 13.5e-9}
DEFAULT_TOPK_SLACK = 4.0  # int8 may take up to this many times the target before top-k replaces it
# Validation loss at equal tokens, relative to float32 (0.01 = 1% worse), of a codec on every boundary's
# activations (forward) or gradients (backward) alone: `small` in 4 stages, 2,002,944 training tokens,
# seed 0, the demo's learning-rate schedule (benchmarks/RESULTS.md, "The table at 2M tokens" and
# "Each direction's codec alone"). int4: 1.9913 (activations) and 2.0370 (gradients) against fp32's
# 1.9729; on both, 2.0487 (+3.84%). int8 was measured on both directions at once (+0.02%), and each
# direction is given all of it. fp16 was not run: its rounding (2^-11 relative) is ~50x finer than
# int8's, whose cost it is given. top-k is not here (not measured at 2M tokens; at 10% it cost +32%
# on `tiny`'s activations): under a budget it is never chosen. One seed: differences under ~0.5% are
# within what a second seed moved fp32 on `tiny` (0.6%).
MEASURED_LOSS_COSTS: dict[str, dict[str, float]] = {
    "activations": {"none": 0.0, "fp16": 0.0002, "int8": 0.0002, "int4": 0.0093},
    "gradients": {"none": 0.0, "fp16": 0.0002, "int8": 0.0002, "int4": 0.0325},
}
# Payload bytes per float32 value, to rank what a budget allows (int8: about 1, plus a code table per tensor).
_BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.53125}
_TOPK_VALUE_BYTES = 2  # float16 / bfloat16


@dataclass(frozen=True)
class LinkEstimate:
    """What we believe about one directed link."""

    bandwidth_bytes_per_s: float
    latency_s: float  # one-way, added once per transfer

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth_bytes_per_s must be positive and finite, got {self.bandwidth_bytes_per_s}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be non-negative and finite, got {self.latency_s}")

    def transfer_s(self, nbytes: int) -> float:
        """Estimated seconds to move ``nbytes`` across the link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class CodecChoice:
    """A codec to use (``registry.get_codec(choice.codec, **choice.params)``) and what we expect."""

    codec: str
    params: dict = field(default_factory=dict)
    estimated_nbytes: int = 0  # payload bytes on the wire
    estimated_transfer_s: float = 0.0  # may exceed the target when even the strongest choice misses it


def estimated_nbytes(codec: str, numel: int, bytes_per_element: int, fraction: float = 1.0) -> int:
    """Payload bytes the codec will send for ``numel`` floating values (``fraction``: top-k only)."""
    if codec == "none":
        return numel * bytes_per_element
    if codec == "fp16":
        return numel * 2
    if codec == "int8":
        per_part = int8_elements_per_part(DEFAULT_MAX_PART_BYTES)
        full_parts, rest = divmod(numel, per_part)
        return full_parts * int8_nbytes(per_part) + (int8_nbytes(rest) if rest or not full_parts else 0)
    if codec == "int4":
        return int4_nbytes(numel)
    if codec == "topk":
        index_bytes = index_dtype_for(numel).itemsize
        return topk_count(numel, fraction) * (_TOPK_VALUE_BYTES + index_bytes)
    raise ValueError(f"no size estimate for codec {codec!r}")


def codecs_within(
    loss_budget: float, costs: dict[str, dict[str, float]] = MEASURED_LOSS_COSTS
) -> dict[str, frozenset[str]]:
    """The codecs the activations and the gradients may use (``{"activations": ..., "gradients":
    ...}``) so that their measured costs, added, stay within ``loss_budget`` (a fraction of the
    validation loss). Of every split of the budget between the two directions, the one whose most
    compressed allowed codecs send the fewest bytes; ties go to the smaller cost. "none" is always
    allowed; a codec without a measured cost never is."""
    if not (math.isfinite(loss_budget) and loss_budget >= 0):
        raise ValueError(f"loss_budget must be a finite fraction >= 0, got {loss_budget}")

    def allowed(direction: str, threshold: float) -> frozenset[str]:
        return frozenset({"none"} | {c for c, cost in costs[direction].items() if max(cost, 0.0) <= threshold})

    best = None  # ((bytes per value of the two strongest codecs, cost), allowed sets)
    for act_threshold in {0.0, *(max(c, 0.0) for c in costs["activations"].values())}:
        for grad_threshold in {0.0, *(max(c, 0.0) for c in costs["gradients"].values())}:
            if act_threshold + grad_threshold > loss_budget + 1e-12:
                continue
            sets = {
                "activations": allowed("activations", act_threshold),
                "gradients": allowed("gradients", grad_threshold),
            }
            score = (
                sum(min(_BYTES_PER_VALUE[c] for c in codecs) for codecs in sets.values()),
                act_threshold + grad_threshold,
            )
            if best is None or score < best[0]:
                best = (score, sets)
    return best[1]


def choose_codec(
    link: LinkEstimate,
    tensor_nbytes: int,
    target_transfer_s: float,
    is_gradient: bool,
    *,
    bytes_per_element: int = 4,
    min_fraction: float | None = None,
    topk_slack: float = DEFAULT_TOPK_SLACK,
    allowed: frozenset[str] | None = None,
) -> CodecChoice:
    """The near-lossless codec that moves the tensor fastest within ``topk_slack * target_transfer_s``
    of serialization, else int4 if it fits that, else top-k (see the module doc).

    ``tensor_nbytes`` is the uncompressed size of a floating tensor with ``bytes_per_element``
    bytes per value (4 for float32). ``min_fraction`` overrides the role's top-k floor;
    ``topk_slack`` is how many times the target int8 may take before top-k is used instead.
    ``allowed``: the only codecs to choose from (a loss budget's, ``codecs_within``); where none
    of them fits, the one sending the fewest bytes.
    """
    if bytes_per_element not in (2, 4, 8):
        raise ValueError(f"bytes_per_element must be 2, 4 or 8 (a floating dtype), got {bytes_per_element}")
    if not isinstance(tensor_nbytes, int) or tensor_nbytes < 0 or tensor_nbytes % bytes_per_element:
        raise ValueError(f"tensor_nbytes must be a non-negative multiple of {bytes_per_element}, got {tensor_nbytes}")
    if not (math.isfinite(target_transfer_s) and target_transfer_s > 0):
        raise ValueError(f"target_transfer_s must be positive and finite, got {target_transfer_s}")
    if not (math.isfinite(topk_slack) and topk_slack >= 1.0):
        raise ValueError(f"topk_slack must be finite and >= 1, got {topk_slack}")
    if min_fraction is None:
        min_fraction = MIN_TOPK_FRACTION_GRADIENT if is_gradient else MIN_TOPK_FRACTION_ACTIVATION
    if not 0.0 < min_fraction <= 1.0:
        raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction}")

    numel = tensor_nbytes // bytes_per_element
    bandwidth = link.bandwidth_bytes_per_s
    budget_bytes = topk_slack * target_transfer_s * bandwidth
    best = None  # (estimated seconds, codec, bytes); ties keep the less lossy codec, tried first
    near_lossless = ["none", "fp16", "int8"] if bytes_per_element > 2 else ["none", "int8"]
    for codec in near_lossless:
        if allowed is not None and codec not in allowed:
            continue
        nbytes = estimated_nbytes(codec, numel, bytes_per_element)
        seconds = CODEC_CPU_S_PER_VALUE[codec] * numel + nbytes / bandwidth
        if nbytes <= budget_bytes and (best is None or seconds < best[0]):
            best = (seconds, codec, nbytes)
    if best is not None:
        _, codec, nbytes = best
        return CodecChoice(codec, {}, nbytes, link.transfer_s(nbytes))
    nbytes = estimated_nbytes("int4", numel, bytes_per_element)
    if nbytes <= budget_bytes and (allowed is None or "int4" in allowed):
        return CodecChoice("int4", {}, nbytes, link.transfer_s(nbytes))
    if allowed is not None and "topk" not in allowed:  # the budget allows nothing smaller: time, not loss
        fewest = min(
            (c for c in [*near_lossless, "int4"] if c in allowed),
            key=lambda c: estimated_nbytes(c, numel, bytes_per_element),
        )
        nbytes = estimated_nbytes(fewest, numel, bytes_per_element)
        return CodecChoice(fewest, {}, nbytes, link.transfer_s(nbytes))

    value_and_index_bytes = _TOPK_VALUE_BYTES + index_dtype_for(numel).itemsize
    fitting_fraction = math.floor(budget_bytes / value_and_index_bytes) / numel  # numel > 0 here
    fraction = min(1.0, max(min_fraction, fitting_fraction))
    nbytes = estimated_nbytes("topk", numel, bytes_per_element, fraction)
    return CodecChoice("topk", {"fraction": fraction}, nbytes, link.transfer_s(nbytes))


@dataclass
class _LinkStats:
    seconds_per_byte: float | None = None  # EMA; averaging time per byte, not bytes per second,
    latency_s: float | None = None  # keeps one very fast tiny sample from dominating
    last_update_s: float | None = None


class LinkBandwidthMeter:
    """Per-link exponential moving averages of measured transfers, as ``LinkEstimate``s.

    A transfer of ``nbytes`` that took ``seconds`` counts as ``nbytes / (seconds - latency)`` with
    the link's current latency estimate (0 until one is recorded), never crediting the bandwidth
    with less than half of the measured time. Pure bookkeeping: no I/O, an injectable clock.
    """

    def __init__(
        self,
        *,
        default: LinkEstimate,
        smoothing: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.default = default  # returned for links without measurements
        self.smoothing = smoothing  # weight of the newest sample
        self._clock = clock
        self._links: dict[Hashable, _LinkStats] = {}
        self._lock = threading.Lock()

    def _ema(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1.0 - self.smoothing) * old + self.smoothing * sample

    def record_transfer(self, link: Hashable, nbytes: int, seconds: float) -> None:
        """Record that ``nbytes`` crossed ``link`` in ``seconds``; empty transfers are ignored."""
        if nbytes < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"need nbytes >= 0 and finite seconds >= 0, got {nbytes} and {seconds}")
        if nbytes == 0 or seconds == 0:
            return
        with self._lock:
            stats = self._links.setdefault(link, _LinkStats())
            transfer_s = max(seconds - (stats.latency_s or 0.0), seconds / 2)
            stats.seconds_per_byte = self._ema(stats.seconds_per_byte, transfer_s / nbytes)
            stats.last_update_s = self._clock()

    def record_latency(self, link: Hashable, latency_s: float) -> None:
        """Record a one-way latency measurement (e.g. half a ping round trip)."""
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s must be finite and >= 0, got {latency_s}")
        with self._lock:
            stats = self._links.setdefault(link, _LinkStats())
            stats.latency_s = self._ema(stats.latency_s, latency_s)
            stats.last_update_s = self._clock()

    @contextmanager
    def measure(self, link: Hashable, nbytes: int) -> Iterator[None]:
        """Time the enclosed transfer with the meter's clock; a transfer that raises is not recorded."""
        started = self._clock()
        yield
        self.record_transfer(link, nbytes, self._clock() - started)

    def estimate(self, link: Hashable) -> LinkEstimate:
        """The current estimate, falling back to ``default`` for what was never measured."""
        with self._lock:
            stats = self._links.get(link, _LinkStats())
            if stats.seconds_per_byte is None:
                bandwidth = self.default.bandwidth_bytes_per_s
            else:
                bandwidth = 1.0 / stats.seconds_per_byte
            latency = self.default.latency_s if stats.latency_s is None else stats.latency_s
        return LinkEstimate(bandwidth, latency)

    def age_s(self, link: Hashable) -> float | None:
        """Seconds since the link's last measurement, None if never measured."""
        with self._lock:
            stats = self._links.get(link)
            return None if stats is None or stats.last_update_s is None else self._clock() - stats.last_update_s

    def links(self) -> list[Hashable]:
        with self._lock:
            return list(self._links)

    def forget(self, link: Hashable) -> None:
        with self._lock:
            self._links.pop(link, None)
