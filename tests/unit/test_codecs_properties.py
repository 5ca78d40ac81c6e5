"""Property tests: whatever a peer sends, decoding yields a tensor of the announced shape and
dtype or raises CodecError, never anything else."""

from __future__ import annotations

import os

import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.compression import BlockwiseInt8Codec, CodecError, EncodedTensor, TensorHeader, decode, get_codec
from wire.compression.base import SUPPORTED_DTYPES

CODECS = [("none", {}), ("fp16", {}), ("int8", {}), ("int4", {}), ("int4", {"block": 8}), ("topk", {"fraction": 0.3})]
# SWARM_CODEC_FUZZ_EXAMPLES=5000 turns these into a longer fuzzing run.
PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("SWARM_CODEC_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module", autouse=True)
def _warm_bitsandbytes():
    BlockwiseInt8Codec.warm_up()


def decodes_or_raises_codec_error(encoded: EncodedTensor) -> None:
    try:
        restored = decode(encoded)
    except CodecError:
        return
    assert restored.shape == encoded.header.shape
    assert restored.dtype == encoded.header.torch_dtype


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=300))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)
header_fields = {
    "codec": st.sampled_from(["none", "fp16", "int8", "int4", "topk", "", "zstd"]) | json_values,
    "shape": st.lists(st.integers(-3, 70), max_size=4) | st.lists(st.integers(0, 2**40), max_size=3) | json_values,
    "dtype": st.sampled_from([*SUPPORTED_DTYPES, "complex64", "float8"]) | json_values,
    "num_parts": st.integers(-2, 5) | json_values,
    "params": st.dictionaries(st.sampled_from(["k", "exponent", "fraction", "block", "x"]), json_values, max_size=3)
    | json_values,
}


@PROPERTY_SETTINGS
@given(
    fields=st.fixed_dictionaries({}, optional=header_fields),
    extra=st.dictionaries(st.text(max_size=8), json_values, max_size=2),
)
def test_malformed_header_dicts_raise_only_codec_error(fields, extra):
    try:
        header = TensorHeader.from_dict({**extra, **fields})
    except CodecError:
        return
    assert TensorHeader.from_dict(header.to_dict()) == header


@st.composite
def arbitrary_parts(draw) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        buffer=draw(st.binary(max_size=200)),
        size=draw(st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 64), max_size=3)),
        dtype=draw(st.sampled_from([*SUPPORTED_DTYPES, "", "float8"]) | st.text(max_size=10)),
        compression=draw(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 99])),
        requires_grad=draw(st.booleans()),
        chunks=draw(st.integers(0, 3)),
    )


@PROPERTY_SETTINGS
@given(
    codec=st.sampled_from(["none", "fp16", "int8", "int4", "topk"]),
    shape=st.lists(st.integers(0, 40), max_size=3),
    dtype=st.sampled_from(list(SUPPORTED_DTYPES)),
    params=st.sampled_from(
        [
            {},
            {"exponent": 0},
            {"exponent": -3},
            {"k": 3, "exponent": 0},
            {"k": 0, "exponent": 0},
            {"block": 8, "exponent": 0},
            {"block": 64, "exponent": -20},
        ]
    ),
    parts=st.lists(arbitrary_parts(), max_size=4),
)
def test_random_parts_never_crash_the_decoder(codec, shape, dtype, params, parts):
    header = TensorHeader(codec, tuple(shape), dtype, len(parts), params)
    decodes_or_raises_codec_error(EncodedTensor(header, tuple(parts)))


@st.composite
def valid_encodings(draw) -> EncodedTensor:
    name, params = draw(st.sampled_from(CODECS))
    shape = draw(st.tuples(st.integers(0, 5000)) | st.tuples(st.integers(0, 1500), st.integers(1, 4)))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64]))
    seed = draw(st.integers(0, 2**16))
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10
    return get_codec(name, max_part_bytes=8192, **params).encode(tensor.to(dtype))


def _copy(part: runtime_pb2.Tensor) -> runtime_pb2.Tensor:
    copied = runtime_pb2.Tensor()
    copied.CopyFrom(part)
    return copied


@PROPERTY_SETTINGS
@given(encoded=valid_encodings(), data=st.data())
def test_truncated_corrupted_or_reshuffled_parts_decode_or_raise_codec_error(encoded, data):
    parts = [_copy(part) for part in encoded.parts]
    header = encoded.header
    mutation = data.draw(st.sampled_from(["truncate", "overwrite", "resize", "drop", "duplicate", "swap", "retype"]))
    index = data.draw(st.integers(0, len(parts) - 1))
    part = parts[index]
    if mutation == "truncate":
        part.buffer = part.buffer[: data.draw(st.integers(0, max(0, len(part.buffer) - 1)))]
    elif mutation == "overwrite" and part.buffer:
        position = data.draw(st.integers(0, len(part.buffer) - 1))
        junk = data.draw(st.binary(min_size=1, max_size=16))
        part.buffer = part.buffer[:position] + junk + part.buffer[position + len(junk) :]
    elif mutation == "resize":
        del part.size[:]
        part.size.extend(data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=2)))
    elif mutation == "drop" and len(parts) > 1:
        del parts[index]
    elif mutation == "duplicate":
        parts.insert(index, _copy(part))
    elif mutation == "swap" and len(parts) > 1:
        parts[0], parts[-1] = parts[-1], parts[0]
    elif mutation == "retype":
        part.dtype = data.draw(st.sampled_from(list(SUPPORTED_DTYPES)))
        part.compression = data.draw(st.sampled_from([0, 2, 5]))
    mutated_header = TensorHeader(header.codec, header.shape, header.dtype, len(parts), header.params)
    decodes_or_raises_codec_error(EncodedTensor(mutated_header, tuple(parts)))


@PROPERTY_SETTINGS
@given(encoded=valid_encodings())
def test_valid_encodings_round_trip_through_the_header_dict(encoded):
    received = EncodedTensor(TensorHeader.from_dict(encoded.header.to_dict()), encoded.parts)
    restored = decode(received)
    assert restored.shape == encoded.header.shape and restored.dtype == encoded.header.torch_dtype
    assert all(len(part.buffer) <= 8192 for part in encoded.parts)


@PROPERTY_SETTINGS
@given(
    values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=300),
    name=st.sampled_from(["none", "fp16"]),
)
def test_finite_float32_values_round_trip_within_fp16_precision(values, name):
    tensor = torch.tensor(values, dtype=torch.float32)
    restored = decode(get_codec(name).encode(tensor))
    largest = tensor.abs().max().item()
    if name == "none":
        assert torch.equal(restored, tensor)
    elif 2**-86 <= largest <= 2**115:  # where the +-100 scale exponent is not clamped
        # Relative to the largest magnitude: values far below it may lose bits, nothing overflows.
        assert torch.all((restored - tensor).abs() <= largest * 2**-11)
        assert torch.isfinite(restored).all()
    else:  # documented limits: tiny tensors flush toward zero, huge ones may overflow to inf
        assert restored.shape == tensor.shape


@PROPERTY_SETTINGS
@given(
    numel=st.integers(0, 300),
    block=st.sampled_from([8, 64, 100]),
    exponent=st.integers(-100, 100),
    dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]),
    data=st.data(),
)
def test_int4_parts_of_the_right_layout_with_random_bytes_decode_bounded_or_raise_codec_error(
    numel, block, exponent, dtype, data
):
    """The int4 decoder's own checks (scales finite and non-negative, code nibbles 1..15, a zero
    padding nibble): whatever passes decodes to values no larger than their block's scale."""
    blocks = -(-numel // block)
    scales = data.draw(st.binary(min_size=2 * blocks, max_size=2 * blocks))
    codes = data.draw(st.binary(min_size=-(-numel // 2), max_size=-(-numel // 2)))
    parts = (
        runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=scales, size=[blocks], dtype="float16"),
        runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=codes, size=[len(codes)], dtype="uint8"),
    )
    encoded = EncodedTensor(TensorHeader("int4", (numel,), dtype, 2, {"block": block, "exponent": exponent}), parts)
    try:
        restored = decode(encoded)
    except CodecError:
        return
    assert restored.shape == (numel,) and restored.dtype == SUPPORTED_DTYPES[dtype]
    scale = torch.tensor(list(scales), dtype=torch.uint8).view(torch.float16).float().repeat_interleave(block)[:numel]
    assert torch.all(restored.float().abs() <= scale * 2.0**exponent * (1 + 2**-7))


def test_int4_scales_beyond_the_dtypes_range_are_refused_not_decoded_to_inf():
    """Found by the property test above in CI: a float16 header whose scale x 2**exponent is past
    float16's range decoded to -inf; the decoder now refuses it."""
    scales = torch.full((1,), 1.5259e-05, dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    parts = (
        runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=scales, size=[1], dtype="float16"),
        runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=bytes([0x11]), size=[1], dtype="uint8"),
    )
    encoded = EncodedTensor(TensorHeader("int4", (2,), "float16", 2, {"block": 8, "exponent": 32}), parts)
    with pytest.raises(CodecError, match="exceed the range of float16"):
        decode(encoded)
