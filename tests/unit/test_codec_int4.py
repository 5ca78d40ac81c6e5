"""The blockwise 4-bit codec (wire.compression.int4): round trips, the per-value error bound its
docstring states, packed sizes, fallbacks and strict decoding."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from wire.compression import (
    RELATIVE_ERROR_BOUNDS,
    BlockwiseInt4Codec,
    CodecError,
    EncodedTensor,
    TensorHeader,
    decode,
    encode,
    get_codec,
)
from wire.compression.adaptive import estimated_nbytes
from wire.compression.int4 import DEFAULT_BLOCK, int4_nbytes


def decoded_scales(encoded: EncodedTensor) -> torch.Tensor:
    """The float32 scale of every block, as the decoder applies it (float16 parts times 2**exponent)."""
    block, exponent = encoded.header.params["block"], encoded.header.params["exponent"]
    blocks = math.ceil(encoded.header.numel / block)
    halves = torch.cat([deserialize_torch_tensor(part) for part in encoded.parts if part.dtype == "float16"])
    assert halves.numel() == blocks
    return halves.float() * 2.0**exponent


def block_absmax(flat: torch.Tensor, block: int) -> torch.Tensor:
    blocks = math.ceil(flat.numel() / block)
    return torch.nn.functional.pad(flat.abs().double(), (0, blocks * block - flat.numel())).view(blocks, -1).amax(1)


def transformer_activations(seed: int = 0) -> torch.Tensor:
    """Outputs of a small TransformerEncoderLayer, (batch, seq, d_model), as in test_codecs.py."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True).eval()
    with torch.no_grad():
        return layer(torch.randn(8, 32, 64, generator=generator))


def with_outlier_channels(seed: int = 0) -> torch.Tensor:
    """Normal values with 3 of 64 channels 20x larger: every block of 64 holds 3 outliers."""
    values = torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(seed))
    values[..., :3] *= 20
    return values


@pytest.mark.parametrize("block", [DEFAULT_BLOCK, 8, 100])
@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 1001, 4097])
@pytest.mark.parametrize("scale", [1e-20, 1e-6, 1.0, 3e4, 1e30])
def test_every_value_is_within_a_fourteenth_of_its_blocks_scale(block, numel, scale):
    """The documented bound: |x - x'| <= scale/14, scale <= absmax * (1 + 2**-10)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * scale
    encoded = BlockwiseInt4Codec(block).encode(x)
    assert encoded.header.codec == "int4"
    restored = decode(encoded)
    scales = decoded_scales(encoded).double()
    absmax = block_absmax(x, block)
    assert torch.all(scales >= absmax)  # rounded up: no value is clipped
    assert torch.all(scales <= absmax * (1 + 2**-10))  # one float16 step up at most (normal scales)
    per_value_scale = scales.repeat_interleave(block)[:numel]
    error = (restored.double() - x.double()).abs()
    assert torch.all(error <= per_value_scale / 14 * (1 + 1e-6))


def test_blocks_far_below_the_largest_keep_their_bound_with_a_subnormal_scale():
    """A block 2**30 times smaller than the largest gets a float16-subnormal scale: still >= its
    absmax and every value within scale/14 (the scale may then exceed absmax by 2**(exponent-24))."""
    x = torch.cat([torch.randn(64), torch.randn(64) * 2.0**-30, torch.zeros(64)])
    encoded = encode(x, "int4")
    restored = decode(encoded)
    scales = decoded_scales(encoded).double()
    assert torch.all(scales >= block_absmax(x, 64)) and scales[2] == 0
    exponent = encoded.header.params["exponent"]
    assert scales[1] <= block_absmax(x, 64)[1] + 2.0 ** (exponent - 24)
    assert torch.all((restored - x).abs().double() <= scales.repeat_interleave(64) / 14 * (1 + 1e-6))
    assert torch.all(restored[128:] == 0)  # zeros stay exactly zero


def test_a_block_whose_absmax_is_no_float16_keeps_its_largest_value_within_the_bound():
    """1 + 2**-11 rounds to 1.0 in float16 (ties to even); the scale goes up to 1 + 2**-10 instead."""
    x = torch.tensor([1 + 2**-11, -0.5, 0.25, 0.0])
    encoded = encode(x, "int4")
    assert decoded_scales(encoded).item() * 2.0 ** -encoded.header.params["exponent"] > 0
    assert decoded_scales(encoded).item() == pytest.approx(1 + 2**-10)
    assert (decode(encoded) - x).abs().max() <= (1 + 2**-10) / 14


@pytest.mark.parametrize(
    "make", [lambda: torch.randn(64, 1000), transformer_activations], ids=["normal", "activations"]
)
def test_relative_error_is_within_the_published_bound(make):
    x = make()
    restored = decode(encode(x, "int4"))
    relative = float((restored - x).norm() / x.norm())
    assert 0.02 < relative <= RELATIVE_ERROR_BOUNDS["int4"]  # lossier than int8, inside its bound


def test_outliers_in_a_block_cost_its_small_values_as_documented():
    """The bound is per block: a block with a value 20x its others quantizes those to 0 or +-1
    level, so outlier channels push the relative error past RELATIVE_ERROR_BOUNDS (0.19 here),
    while each value still keeps its scale/14 bound."""
    x = with_outlier_channels()
    encoded = encode(x, "int4")
    restored = decode(encoded)
    relative = float((restored - x).norm() / x.norm())
    assert RELATIVE_ERROR_BOUNDS["int4"] < relative < 0.25
    scales = decoded_scales(encoded).double().repeat_interleave(DEFAULT_BLOCK).view(x.shape)
    assert torch.all((restored - x).abs().double() <= scales / 14 * (1 + 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_floating_dtypes_come_back_in_their_dtype_within_the_bound(dtype):
    x = (torch.randn(3, 333) * 5).to(dtype)
    encoded = encode(x, "int4")
    restored = decode(encoded)
    assert restored.dtype == dtype and restored.shape == x.shape and encoded.header.dtype == str(dtype)[6:]
    scales = decoded_scales(encoded).double().repeat_interleave(DEFAULT_BLOCK)[: x.numel()].view(3, 333)
    rounding = restored.double().abs() * (2**-8 if dtype == torch.bfloat16 else 2**-11)  # to the output dtype
    assert torch.all((restored.double() - x.double()).abs() <= scales / 14 * (1 + 1e-6) + rounding)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (7,), (2, 3, 5), (4097,)])
def test_odd_shapes_and_empty_tensors_round_trip(shape):
    x = torch.randn(shape)
    encoded = encode(x, "int4")
    restored = decode(encoded)
    assert restored.shape == x.shape and restored.dtype == x.dtype
    assert encoded.nbytes == int4_nbytes(x.numel())


@pytest.mark.parametrize("numel", [0, 1, 2, 63, 64, 65, 1_000_001])
def test_packed_size_is_two_codes_per_byte_plus_a_float16_scale_per_block(numel):
    encoded = encode(torch.randn(numel), "int4")
    expected = math.ceil(numel / 2) + 2 * math.ceil(numel / 64)
    assert encoded.nbytes == expected == int4_nbytes(numel) == estimated_nbytes("int4", numel, 4)
    if numel == 1_000_001:
        assert numel * 4 / encoded.nbytes > 7.5  # float32 over int4: 4 / 0.53125 = 7.53


def test_a_custom_block_size_travels_in_the_header():
    x = torch.randn(1000)
    encoded = get_codec("int4", block=256).encode(x)
    assert encoded.header.params["block"] == 256 and encoded.nbytes == int4_nbytes(1000, 256)
    assert decode(encoded).shape == x.shape
    for block in (4, 5000, 64.0, True):
        with pytest.raises(CodecError):
            get_codec("int4", block=block)


def test_parts_are_bounded_and_each_is_a_valid_hivemind_tensor():
    encoded = BlockwiseInt4Codec(max_part_bytes=8192).encode(torch.randn(100_000))
    assert len(encoded.parts) > 2
    for part in encoded.parts:
        assert len(part.buffer) <= 8192 and part.compression == runtime_pb2.NONE
        assert deserialize_torch_tensor(part).numel() == part.size[0]


def test_non_floating_go_as_none_non_finite_as_fp16_and_overflowing_as_none():
    ids = torch.randint(0, 50_000, (4, 9))
    assert encode(ids, "int4").header.codec == "none" and torch.equal(decode(encode(ids, "int4")), ids)
    with_nan = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    fallback = encode(with_nan, "int4")
    assert fallback.header.codec == "fp16" and torch.equal(decode(fallback).isnan(), with_nan.isnan())
    huge = torch.tensor([1e37, -3e36, 1.0])  # beyond 65504 * 2**100: no float16 scale holds it
    assert encode(huge, "int4").header.codec == "none" and torch.equal(decode(encode(huge, "int4")), huge)


# ---------------------------------------------------------------- strict decoding


def _with_part(encoded: EncodedTensor, index: int, buffer: bytes) -> EncodedTensor:
    parts = list(encoded.parts)
    part = runtime_pb2.Tensor()
    part.CopyFrom(parts[index])
    part.buffer = buffer
    parts[index] = part
    return EncodedTensor(encoded.header, tuple(parts))


def _with_params(encoded: EncodedTensor, params: dict) -> EncodedTensor:
    header = TensorHeader(encoded.header.codec, encoded.header.shape, encoded.header.dtype, len(encoded.parts), params)
    return EncodedTensor(header, encoded.parts)


def test_zero_code_nibbles_and_dirty_padding_are_rejected():
    encoded = encode(torch.randn(5), "int4")  # 3 code bytes, the last high nibble is padding
    scales, codes = encoded.parts
    good = bytes(codes.buffer)
    assert good[-1] >> 4 == 0
    for bad in (
        bytes([good[0] & 0xF0]) + good[1:],
        bytes([good[0] & 0x0F]) + good[1:],
        good[:-1] + bytes([0x10 | good[-1]]),
    ):
        with pytest.raises(CodecError, match="nibble"):
            decode(_with_part(encoded, 1, bad))
    assert torch.equal(decode(_with_part(encoded, 1, good)), decode(encoded))


@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0, -0.0])
def test_non_finite_or_negative_scales_are_rejected(bad_scale):
    encoded = encode(torch.randn(5), "int4")
    forged = torch.tensor([bad_scale], dtype=torch.float16).view(torch.int16).numpy().tobytes()
    with pytest.raises(CodecError, match="scales"):
        decode(_with_part(encoded, 0, forged))


@pytest.mark.parametrize(
    "params",
    [
        {"block": 64},
        {"exponent": 0},
        {"block": 64, "exponent": 0, "k": 1},
        {"block": 4, "exponent": 0},
        {"block": 10**6, "exponent": 0},
        {"block": 64.0, "exponent": 0},
        {"block": 64, "exponent": 101},
        {"block": 64, "exponent": "0"},
    ],
)
def test_malformed_params_are_rejected(params):
    with pytest.raises(CodecError):
        decode(_with_params(encode(torch.randn(100), "int4"), params))


def test_a_changed_block_size_no_longer_matches_the_parts():
    encoded = encode(torch.randn(1000), "int4")  # 16 scales for blocks of 64
    with pytest.raises(CodecError):
        decode(_with_params(encoded, {"block": 32, "exponent": encoded.header.params["exponent"]}))


def test_a_huge_header_with_tiny_parts_is_rejected_before_allocating():
    tiny = encode(torch.randn(1), "int4")
    header = TensorHeader("int4", (2**28,), "float32", 2, {"block": 64, "exponent": 0})
    with pytest.raises(CodecError):
        decode(EncodedTensor(header, tiny.parts))


def test_the_trainer_offers_int4_as_a_fixed_codec():
    """`--codec int4` (swarm train, swarm demo) takes its choices from the registry."""
    from wire.compression.policy import CODEC_MODES, CodecPolicy

    assert CODEC_MODES.index("int8") < CODEC_MODES.index("int4") < CODEC_MODES.index("topk")
    choice = CodecPolicy("int4").choose("peer", 1, numel=4096, batch_size=2, is_gradient=True)
    assert (choice.codec, choice.params) == ("int4", {})
