"""Blockwise 4-bit codec ("int4"): per block of ``block`` values one float16 scale, and one signed
4-bit code per value, two codes per byte. Our own code, not bitsandbytes'.

Wire format (all parts raw, ``compression=NONE``): ``ceil(numel / block)`` float16 scales, then
``ceil(numel / 2)`` uint8 bytes of codes (low nibble first); header params ``{"block", "exponent"}``
(scales times ``2**exponent``, the rule of "fp16"). A nibble ``c`` in 1..15 decodes to
``(c - 8) * scale / 7``; nibble 0 is rejected, except as the padding of an odd-length tensor.

Error bound: a block's scale is its absmax rounded up to float16, and every decoded value is within
``scale / 14`` of the original (plus the rounding to the tensor's dtype): a relative L2 error of
~0.11 on normal-like data (``RELATIVE_ERROR_BOUNDS["int4"]``). Bytes per value ``1/2 + 2/block``:
0.53125 at the default 64, 7.5x fewer than float32.

As "int8": non-floating tensors go as "none"; inf or nan go as "fp16"; magnitudes beyond the
clamped scales go as "none". The exact bound and its edge cases: docs/design/wire.md.
"""

from __future__ import annotations

import math

import torch

from wire.compression.base import (
    DEFAULT_MAX_PART_BYTES,
    FLOATING_DTYPES,
    Codec,
    CodecError,
    EncodedTensor,
    TensorHeader,
)
from wire.compression.codecs import (
    MAX_SCALE_EXPONENT,
    Float16Codec,
    NoneCodec,
    _check_params,
    _flatten,
    float16_scale_exponent,
)
from wire.compression.parts import PartReader, raw_parts

DEFAULT_BLOCK = 64
MIN_BLOCK, MAX_BLOCK = 8, 4096
LEVELS = 7  # codes -7..7: 15 levels symmetric around 0, so 0 is exact
_OFFSET = 8  # nibble = code + 8, in 1..15
_FLOAT16_MAX = 65504.0


def int4_nbytes(numel: int, block: int = DEFAULT_BLOCK) -> int:
    """Payload bytes of an int4-encoded tensor of ``numel`` values: scales plus packed codes."""
    return 2 * math.ceil(numel / block) + math.ceil(numel / 2)


def _round_up_to_float16(target: torch.Tensor) -> torch.Tensor:
    """The smallest float16 values >= ``target`` (non-negative float64, at most 65504)."""
    scales = target.to(torch.float16)
    too_small = scales.double() < target
    if bool(too_small.any()):  # non-negative float16 bit patterns increase with the value
        bits = scales.view(torch.int16)
        bits[too_small] += 1
    return scales


def _pack(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles (1-D) -> bytes, low nibble first; an odd count gets a 0 high nibble last."""
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Bytes -> ``numel`` nibbles (uint8), refusing the 0 nibble wherever a value is encoded."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)
    if numel % 2 and nibbles[-1] != 0:
        raise CodecError("int4: the padding nibble after an odd number of values must be 0")
    nibbles = nibbles[:numel]
    if bool((nibbles == 0).any()):
        raise CodecError("int4: a code nibble is 0 (valid codes are 1..15)")
    return nibbles


class BlockwiseInt4Codec(Codec):
    """Blockwise absmax 4-bit quantization: ~0.53 bytes per value with blocks of 64; every value
    within ``scale / 14`` of the original (module doc)."""

    name = "int4"

    def __init__(self, block: int = DEFAULT_BLOCK, *, max_part_bytes: int = DEFAULT_MAX_PART_BYTES):
        super().__init__(max_part_bytes=max_part_bytes)
        if type(block) is not int or not MIN_BLOCK <= block <= MAX_BLOCK:
            raise CodecError(f"int4 block must be an int in [{MIN_BLOCK}, {MAX_BLOCK}], got {block!r}")
        self.block = block

    @property
    def params(self) -> dict:
        return {"block": self.block}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat, name = _flatten(tensor)
        if name not in FLOATING_DTYPES:
            return NoneCodec(max_part_bytes=self.max_part_bytes).encode(tensor)
        values = flat.to(torch.promote_types(flat.dtype, torch.float32))
        if not bool(torch.isfinite(values).all()):
            return Float16Codec(max_part_bytes=self.max_part_bytes).encode(tensor)
        numel, block = values.numel(), self.block
        blocks = math.ceil(numel / block)
        padded = torch.nn.functional.pad(values, (0, blocks * block - numel)).view(blocks, block)
        absmax = padded.abs().amax(dim=1) if blocks else padded.new_zeros(0)
        exponent = float16_scale_exponent(absmax.float())
        target = absmax.double() * 2.0**-exponent
        if blocks and float(target.max()) > _FLOAT16_MAX:  # beyond the clamped exponent's reach
            return NoneCodec(max_part_bytes=self.max_part_bytes).encode(tensor)
        scales = _round_up_to_float16(target)
        step = scales.to(torch.float32) * 2.0**exponent / LEVELS  # what the decoder multiplies by
        divisor = torch.where(step > 0, step, torch.ones_like(step))  # a zero step: an all-zero block
        codes = torch.round(padded / divisor[:, None]).clamp_(-LEVELS, LEVELS)
        nibbles = (codes.reshape(-1)[:numel] + _OFFSET).to(torch.uint8)
        parts = raw_parts(scales, self.max_part_bytes) + raw_parts(_pack(nibbles), self.max_part_bytes)
        params = {"block": block, "exponent": exponent}
        return EncodedTensor(TensorHeader(self.name, tuple(tensor.shape), name, len(parts), params), tuple(parts))

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        self._check_header_codec(encoded)
        header = encoded.header
        if header.dtype not in FLOATING_DTYPES:
            raise CodecError(f"'int4' carries floating tensors only, header says {header.dtype}")
        params = _check_params(encoded, {"block": int, "exponent": int})
        block, exponent = params["block"], params["exponent"]
        if not MIN_BLOCK <= block <= MAX_BLOCK:
            raise CodecError(f"int4 block {block} is outside [{MIN_BLOCK}, {MAX_BLOCK}]")
        if not -MAX_SCALE_EXPONENT <= exponent <= MAX_SCALE_EXPONENT:
            raise CodecError(f"scale exponent {exponent} is outside [-{MAX_SCALE_EXPONENT}, {MAX_SCALE_EXPONENT}]")
        numel = header.numel
        blocks = math.ceil(numel / block)
        reader = PartReader(encoded.parts)
        scales = reader.read_raw(blocks, "float16")
        packed = reader.read_raw(math.ceil(numel / 2), "uint8")
        reader.finish()
        if blocks and not (bool(torch.isfinite(scales).all()) and not bool(torch.signbit(scales).any())):
            raise CodecError("int4 scales must be finite and non-negative")
        nibbles = _unpack(packed, numel)
        codes = torch.nn.functional.pad(nibbles.to(torch.float32) - _OFFSET, (0, blocks * block - numel))
        step = scales.to(torch.float32) * 2.0**exponent / LEVELS
        values = (codes.view(blocks, block) * step[:, None]).reshape(-1)[:numel].to(header.torch_dtype)
        if not bool(torch.isfinite(values).all()):  # scale x 2**exponent beyond what the dtype holds
            raise CodecError(f"int4 scales x 2**{exponent} exceed the range of {header.dtype}")
        return values.reshape(header.shape)
