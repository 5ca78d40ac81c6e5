"""Four of the codecs: "none", "fp16", "int8" and "topk" ("int4" is in `wire.compression.int4`).

    codec  bytes per float32 value  error
    none   4                        exact
    fp16   2                        ~5e-4 per value
    int8   ~1.001                   ~0.01-0.02 rel. L2 (hivemind BLOCKWISE_8BIT)
    topk   6 * fraction             kept values as fp16, the rest zero

Policies every codec follows:

- Non-floating tensors go losslessly, as "none"; "none" sends integers as the narrowest type that
  holds their range, shifted by an offset (token ids of a 256-token vocabulary: 1 byte each).
- float16 and bfloat16 values go as their own 16 bits, so "fp16" is lossless for them.
- float32/float64 values sent as float16 are first scaled by a power of two (the header's
  ``exponent``, clamped to [-100, 100]) that puts the largest finite magnitude in [2**14, 2**15).
- "int8" cannot carry inf or nan: such a tensor is sent with "fp16" instead.

Each format and its limits: docs/design/wire.md.
"""

from __future__ import annotations

import math
import time

import torch

from wire.compression.base import (
    DEFAULT_MAX_PART_BYTES,
    FLOATING_DTYPES,
    SUPPORTED_DTYPES,
    Codec,
    CodecError,
    EncodedTensor,
    TensorHeader,
    dtype_name,
)
from wire.compression.parts import PartReader, int8_parts, raw_parts

# The error column above as numbers: the most ||decode(encode(x)) - x|| / ||x|| may be for a float32
# tensor (tests/unit/test_codecs.py checks these on random and activation-like tensors). top-k drops
# the rest of the tensor, so nothing below 1 bounds it.
RELATIVE_ERROR_BOUNDS = {"none": 0.0, "fp16": 1e-3, "int8": 0.02, "int4": 0.12, "topk": 1.0}


def relative_error_bound(codec: str) -> float:
    """The relative L2 error `codec` may add to a float32 tensor (RELATIVE_ERROR_BOUNDS)."""
    try:
        return RELATIVE_ERROR_BOUNDS[codec]
    except KeyError:
        raise CodecError(f"no error bound is known for codec {codec!r}") from None


SIXTEEN_BIT_DTYPES = frozenset({"float16", "bfloat16"})
# Scaling exponents a header may carry; 2**±100 is a normal float32, so decoding never underflows.
MAX_SCALE_EXPONENT = 100
# float16 has 16 exponent steps above 2**-14 (its smallest normal); aim the largest value at 2**14.
_FLOAT16_TOP_EXPONENT = 14
# Flat indices up to this fit int32; larger tensors (beyond MAX_NUMEL today) would use int64.
INT32_INDEX_LIMIT = 2**31 - 1


def _flatten(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A detached, contiguous, 1-D CPU view or copy of ``tensor``, and its dtype name."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise CodecError(f"only dense tensors can be encoded, got layout {tensor.layout}")
    name = dtype_name(tensor.dtype)
    return tensor.detach().cpu().reshape(-1).contiguous(), name


def _check_params(encoded: EncodedTensor, expected: dict[str, type]) -> dict:
    params = encoded.header.params
    if set(params) != set(expected):
        raise CodecError(f"{encoded.header.codec!r} header params must be {sorted(expected)}, got {sorted(params)}")
    for key, kind in expected.items():
        if type(params[key]) is not kind:
            raise CodecError(f"header param {key!r} must be {kind.__name__}, got {params[key]!r}")
    return params


def _check_exponent(exponent: int, original_dtype: str) -> None:
    if not -MAX_SCALE_EXPONENT <= exponent <= MAX_SCALE_EXPONENT:
        raise CodecError(f"scale exponent {exponent} is outside [-{MAX_SCALE_EXPONENT}, {MAX_SCALE_EXPONENT}]")
    if original_dtype in SIXTEEN_BIT_DTYPES and exponent != 0:
        raise CodecError(f"{original_dtype} values are sent unscaled, got exponent {exponent}")


def float16_scale_exponent(flat: torch.Tensor) -> int:
    """Power of two ``e`` such that ``max|finite x| * 2**-e`` lies in [2**14, 2**15) (clamped)."""
    if flat.numel() == 0:
        return 0
    low, high = (value.item() for value in torch.aminmax(flat))
    if math.isfinite(low) and math.isfinite(high):
        max_abs = max(-low, high)
    else:
        finite = flat[torch.isfinite(flat)]
        max_abs = finite.abs().max().item() if finite.numel() else 0.0
    if max_abs == 0.0:
        return 0
    exponent = math.frexp(max_abs)[1] - 1 - _FLOAT16_TOP_EXPONENT
    return max(-MAX_SCALE_EXPONENT, min(MAX_SCALE_EXPONENT, exponent))


def to_16bit_wire(flat: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """Floating values as the 16-bit tensor to send and the exponent to scale them back with."""
    if name in SIXTEEN_BIT_DTYPES:
        return flat, 0
    exponent = float16_scale_exponent(flat)
    scaled = flat * 2.0**-exponent if exponent else flat
    return scaled.to(torch.float16), exponent


def from_16bit_wire(values: torch.Tensor, exponent: int, original: torch.dtype) -> torch.Tensor:
    restored = values.to(original)
    return restored.mul_(2.0**exponent) if exponent else restored


def _wire_16bit_dtype(original_dtype: str) -> str:
    return original_dtype if original_dtype in SIXTEEN_BIT_DTYPES else "float16"


# What an integer tensor may be narrowed to, narrowest first: (dtype, smallest, largest value).
_NARROW_INTEGERS = (("uint8", 0, 2**8 - 1), ("int16", -(2**15), 2**15 - 1), ("int32", -(2**31), 2**31 - 1))
_NARROWED_DTYPES = frozenset({"int64", "int32", "int16"})
MAX_NARROW_OFFSET = 2**62  # an offset beyond this is no range an int64 tensor narrows into


def narrow_integers(flat: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """`flat` (1-D int64/int32/int16) as the narrowest integer type that holds its range, shifted by
    an offset, with the header params that undo it; `flat` and {} when nothing narrower holds it."""
    if dtype_name(flat.dtype) not in _NARROWED_DTYPES or flat.numel() == 0:
        return flat, {}
    lowest, highest = int(flat.min()), int(flat.max())
    for name, smallest, largest in _NARROW_INTEGERS:
        narrow = SUPPORTED_DTYPES[name]
        if narrow.itemsize >= flat.element_size():
            break
        if highest - lowest <= largest - smallest:
            offset = lowest - smallest
            return (flat.to(torch.int64) - offset).to(narrow), {"narrow": name, "offset": offset}
    return flat, {}


def widen_integers(values: torch.Tensor, params: dict, original_dtype: str) -> torch.Tensor:
    """The inverse of `narrow_integers`: CodecError for params or values that cannot have come from it."""
    narrow, offset = params["narrow"], params["offset"]
    if original_dtype not in _NARROWED_DTYPES or narrow not in {name for name, _, _ in _NARROW_INTEGERS}:
        raise CodecError(f"{original_dtype} values cannot be sent narrowed to {narrow!r}")
    if SUPPORTED_DTYPES[narrow].itemsize >= SUPPORTED_DTYPES[original_dtype].itemsize:
        raise CodecError(f"{narrow} is no narrower than {original_dtype}")
    if abs(offset) > MAX_NARROW_OFFSET:
        raise CodecError(f"offset {offset} is out of range")
    wide = values.to(torch.int64) + offset
    info = torch.iinfo(SUPPORTED_DTYPES[original_dtype])
    if wide.numel() and (int(wide.min()) < info.min or int(wide.max()) > info.max):
        raise CodecError(f"narrowed values plus offset {offset} do not fit {original_dtype}")
    return wide.to(SUPPORTED_DTYPES[original_dtype])


class NoneCodec(Codec):
    """Sends the values as they are: exact, any supported dtype (integers narrowed, losslessly)."""

    name = "none"

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat, name = _flatten(tensor)
        flat, params = narrow_integers(flat)
        parts = raw_parts(flat, self.max_part_bytes)
        return EncodedTensor(TensorHeader(self.name, tuple(tensor.shape), name, len(parts), params), tuple(parts))

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        self._check_header_codec(encoded)
        header = encoded.header
        reader = PartReader(encoded.parts)
        if header.params:
            params = _check_params(encoded, {"narrow": str, "offset": int})
            if params["narrow"] not in SUPPORTED_DTYPES:
                raise CodecError(f"header param 'narrow' names no supported dtype: {params['narrow']!r:.40}")
            flat = widen_integers(reader.read_raw(header.numel, params["narrow"]), params, header.dtype)
        else:
            flat = reader.read_raw(header.numel, header.dtype)
        reader.finish()
        return flat.reshape(header.shape)


class Float16Codec(Codec):
    """Sends floating values as 16 bits: 2 bytes per value, relative error ~5e-4 per value."""

    name = "fp16"

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat, name = _flatten(tensor)
        if name not in FLOATING_DTYPES:
            return NoneCodec(max_part_bytes=self.max_part_bytes).encode(tensor)
        wire, exponent = to_16bit_wire(flat, name)
        parts = raw_parts(wire, self.max_part_bytes)
        header = TensorHeader(self.name, tuple(tensor.shape), name, len(parts), {"exponent": exponent})
        return EncodedTensor(header, tuple(parts))

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        self._check_header_codec(encoded)
        header = encoded.header
        if header.dtype not in FLOATING_DTYPES:
            raise CodecError(f"'fp16' carries floating tensors only, header says {header.dtype}")
        exponent = _check_params(encoded, {"exponent": int})["exponent"]
        _check_exponent(exponent, header.dtype)
        reader = PartReader(encoded.parts)
        wire = reader.read_raw(header.numel, _wire_16bit_dtype(header.dtype))
        reader.finish()
        return from_16bit_wire(wire, exponent, header.torch_dtype).reshape(header.shape)


class BlockwiseInt8Codec(Codec):
    """Blockwise 8-bit quantization (hivemind BLOCKWISE_8BIT, bitsandbytes on CPU): one byte per
    value plus one float32 scale per 4096 values; relative L2 error ~0.01-0.02."""

    name = "int8"

    @classmethod
    def warm_up(cls) -> float:
        """Load bitsandbytes' kernels (~1-2 s on the first call in a process) by encoding and
        decoding a small tensor; call at start-up, not on the first request. Returns seconds."""
        started = time.perf_counter()
        codec = cls()
        codec.decode(codec.encode(torch.linspace(-1.0, 1.0, 4096)))
        return time.perf_counter() - started

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat, name = _flatten(tensor)
        if name not in FLOATING_DTYPES:
            return NoneCodec(max_part_bytes=self.max_part_bytes).encode(tensor)
        values = flat.to(torch.float32)
        if not bool(torch.isfinite(values).all()):
            return Float16Codec(max_part_bytes=self.max_part_bytes).encode(tensor)
        parts = int8_parts(values, self.max_part_bytes)
        return EncodedTensor(TensorHeader(self.name, tuple(tensor.shape), name, len(parts), {}), tuple(parts))

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        self._check_header_codec(encoded)
        header = encoded.header
        if header.dtype not in FLOATING_DTYPES:
            raise CodecError(f"'int8' carries floating tensors only, header says {header.dtype}")
        _check_params(encoded, {})
        reader = PartReader(encoded.parts)
        values = reader.read_int8(header.numel)
        reader.finish()
        return values.to(header.torch_dtype).reshape(header.shape)


def topk_count(numel: int, fraction: float) -> int:
    """How many values top-k keeps: ceil(fraction * numel), at least one of a non-empty tensor."""
    return min(numel, max(1, math.ceil(fraction * numel))) if numel else 0


# Above this many values, top-k first narrows the candidates with a threshold from a sample.
_TOPK_SAMPLING_MIN_NUMEL = 2**16
_TOPK_SAMPLE_SIZE = 2**16


def largest_magnitude_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending flat indices of ``k`` values of largest magnitude (exact; ties broken arbitrarily).

    ``torch.topk`` over millions of values costs tens of milliseconds on CPU. For large tensors
    and small fractions we take a threshold from a fixed-seed random sample that leaves ~25% more
    than k candidates, run topk on those only, and fall back to a full topk when the sample was
    unlucky and fewer than k values pass. Deterministic for a given tensor.
    """
    magnitudes = flat.abs() if flat.dtype != torch.bfloat16 else flat.float().abs()
    numel = flat.numel()
    if numel >= _TOPK_SAMPLING_MIN_NUMEL and 4 * k <= numel:
        sample_at = torch.randint(numel, (_TOPK_SAMPLE_SIZE,), generator=torch.Generator().manual_seed(0))
        keep_in_sample = math.ceil(1.25 * k * _TOPK_SAMPLE_SIZE / numel) + 32
        if keep_in_sample < _TOPK_SAMPLE_SIZE:
            threshold = magnitudes[sample_at].kthvalue(_TOPK_SAMPLE_SIZE - keep_in_sample).values
            candidates = (magnitudes > threshold).nonzero().squeeze(1)
            if candidates.numel() >= k:
                chosen = torch.topk(magnitudes[candidates], k, sorted=False).indices
                return candidates[chosen].sort().values
    return torch.topk(magnitudes, k, sorted=False).indices.sort().values


def index_dtype_for(numel: int) -> torch.dtype:
    return torch.int32 if numel - 1 <= INT32_INDEX_LIMIT else torch.int64


class TopKCodec(Codec):
    """Keeps the ``fraction`` of values with the largest magnitude, sends them as 16 bits with
    their flat indices (ascending, int32), and decodes into zeros elsewhere.

    Bytes per value of the original tensor: ``6 * fraction`` (int32 indices). Meant for slow
    links; for gradients wrap it in ``ErrorFeedback`` so that what is dropped is sent later.
    """

    name = "topk"

    def __init__(self, fraction: float = 0.01, *, max_part_bytes: int = DEFAULT_MAX_PART_BYTES):
        super().__init__(max_part_bytes=max_part_bytes)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise CodecError(f"top-k fraction must be in (0, 1], got {fraction!r}")
        self.fraction = float(fraction)

    @property
    def params(self) -> dict:
        return {"fraction": self.fraction}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat, name = _flatten(tensor)
        if name not in FLOATING_DTYPES:
            return NoneCodec(max_part_bytes=self.max_part_bytes).encode(tensor)
        k = topk_count(flat.numel(), self.fraction)
        indices = torch.arange(k) if k == flat.numel() else largest_magnitude_indices(flat, k)
        values, exponent = to_16bit_wire(flat[indices], name)
        index_parts = raw_parts(indices.to(index_dtype_for(flat.numel())), self.max_part_bytes)
        parts = raw_parts(values, self.max_part_bytes) + index_parts
        header = TensorHeader(self.name, tuple(tensor.shape), name, len(parts), {"k": k, "exponent": exponent})
        return EncodedTensor(header, tuple(parts))

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        self._check_header_codec(encoded)
        header = encoded.header
        if header.dtype not in FLOATING_DTYPES:
            raise CodecError(f"'topk' carries floating tensors only, header says {header.dtype}")
        params = _check_params(encoded, {"k": int, "exponent": int})
        k, exponent = params["k"], params["exponent"]
        if not 0 <= k <= header.numel:
            raise CodecError(f"top-k header keeps {k} of {header.numel} values")
        _check_exponent(exponent, header.dtype)
        reader = PartReader(encoded.parts)
        wire_values = reader.read_raw(k, _wire_16bit_dtype(header.dtype))
        index_dtype = dtype_name(index_dtype_for(header.numel))
        indices = reader.read_raw(k, index_dtype).long()
        reader.finish()
        if k and (indices[0] < 0 or indices[-1] >= header.numel or not bool((indices[1:] > indices[:-1]).all())):
            raise CodecError(f"top-k indices must be strictly increasing and within [0, {header.numel})")
        out = torch.zeros(header.numel, dtype=header.torch_dtype)
        out[indices] = from_16bit_wire(wire_values, exponent, header.torch_dtype)
        return out.reshape(header.shape)
