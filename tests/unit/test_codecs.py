"""Round trips, error bounds, compression ratios and strict decoding of wire.compression codecs."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from wire.compression import (
    BlockwiseInt8Codec,
    ByteCounter,
    CodecError,
    EncodedTensor,
    ErrorFeedback,
    Float16Codec,
    NoneCodec,
    TensorHeader,
    TopKCodec,
    UnknownCodecError,
    decode,
    encode,
    get_codec,
    known_codecs,
)
from wire.compression.base import DEFAULT_MAX_PART_BYTES, MAX_NUMEL

SMALL_PARTS = 8192  # forces several parts on small tensors
ALL_CODECS = [("none", {}), ("fp16", {}), ("int8", {}), ("int4", {}), ("topk", {"fraction": 0.1})]


@pytest.fixture(scope="module", autouse=True)
def _warm_bitsandbytes():
    BlockwiseInt8Codec.warm_up()


def relative_l2(restored: torch.Tensor, original: torch.Tensor) -> float:
    return float((restored.double() - original.double()).norm() / original.double().norm())


def transformer_activations(seed: int = 0) -> torch.Tensor:
    """Outputs of a small TransformerEncoderLayer: realistic activations, (batch, seq, d_model)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True).eval()
    with torch.no_grad():
        return layer(torch.randn(8, 32, 64, generator=generator))  # (B, T, d)


def random_normal(shape=(64, 1000), scale=1.0, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- round trips and error bounds


@pytest.mark.parametrize("make", [random_normal, transformer_activations], ids=["normal", "activations"])
@pytest.mark.parametrize(
    ("name", "bound"),
    [("none", 0.0), ("fp16", 1e-3), ("int8", 0.02), ("int4", 0.12)],
)
def test_dense_codecs_round_trip_within_their_error_bound(make, name, bound):
    tensor = make()
    for max_part_bytes in (DEFAULT_MAX_PART_BYTES, SMALL_PARTS):
        encoded = get_codec(name, max_part_bytes=max_part_bytes).encode(tensor)
        restored = decode(encoded)
        assert restored.shape == tensor.shape and restored.dtype == tensor.dtype
        assert encoded.header.codec == name
        assert relative_l2(restored, tensor) <= bound
        if name == "none":
            assert torch.equal(restored, tensor)


@pytest.mark.parametrize("make", [random_normal, transformer_activations], ids=["normal", "activations"])
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.25, 1.0])
def test_topk_keeps_the_largest_values_exact_to_fp16_and_zeroes_the_rest(make, fraction):
    tensor = make()
    encoded = TopKCodec(fraction, max_part_bytes=SMALL_PARTS).encode(tensor)
    restored = decode(encoded)
    flat, restored_flat = tensor.reshape(-1), restored.reshape(-1)
    k = math.ceil(fraction * flat.numel())
    assert encoded.header.params["k"] == k
    kept = torch.topk(flat.abs(), k).indices
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[kept] = True
    assert torch.all(restored_flat[~mask] == 0)
    # Kept values are rounded to float16 precision: within half a float16 ulp (2**-11 relative).
    kept_error = (restored_flat[mask] - flat[mask]).abs()
    assert torch.all(kept_error <= flat[mask].abs() * 2**-11)


def test_topk_of_a_scalar_and_of_an_empty_tensor():
    assert torch.equal(decode(TopKCodec(0.01).encode(torch.tensor(3.0))), torch.tensor(3.0))
    empty = decode(TopKCodec(0.5).encode(torch.empty(0, 7)))
    assert empty.shape == (0, 7)


@pytest.mark.parametrize(("name", "params"), ALL_CODECS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (4097,), (2, 3, 4, 5)])
def test_odd_shapes_round_trip(name, params, shape):
    tensor = torch.randn(shape)
    restored = encode(tensor, name, **params).header and decode(encode(tensor, name, **params))
    assert restored.shape == tensor.shape and restored.dtype == tensor.dtype


def test_fp16_keeps_precision_on_tiny_gradients_and_range_on_huge_values():
    """Plain float16 loses tiny gradients to its subnormal range and overflows above 65504; the
    power-of-two scaling keeps ~5e-4 relative error per value at both ends."""
    for scale in (1e-7, 1e-3, 1.0, 1e6):
        tensor = random_normal(scale=scale)
        restored = decode(Float16Codec().encode(tensor))
        assert float(((restored - tensor).abs() / tensor.abs().clamp_min(1e-30 * scale)).median()) < 5e-4
        assert relative_l2(restored, tensor) < 1e-3
    naive = tensor_1e7 = random_normal(scale=1e-7)
    assert relative_l2(naive.half().float(), tensor_1e7) > 1e-2  # what the scaling avoids


# ---------------------------------------------------------------- sizes


def test_compression_ratios_on_a_1m_float32_tensor():
    tensor = random_normal(shape=(1024, 1024))
    original = tensor.numel() * 4
    assert encode(tensor, "none").nbytes == original
    assert encode(tensor, "fp16").nbytes == original // 2
    int8 = encode(tensor, "int8")
    assert original / int8.nbytes >= 3.5
    topk = encode(tensor, "topk", fraction=0.01)
    k = math.ceil(0.01 * tensor.numel())
    assert topk.nbytes == k * (2 + 4)  # float16 value + int32 index
    assert original / topk.nbytes == pytest.approx(4 / (6 * 0.01), rel=1e-3)


@pytest.mark.parametrize(("name", "params"), ALL_CODECS)
def test_parts_stay_under_max_part_bytes_and_each_is_a_valid_hivemind_tensor(name, params):
    tensor = random_normal(shape=(300, 1000))
    codec = get_codec(name, max_part_bytes=65536, **params)
    encoded = codec.encode(tensor)
    assert len(encoded.parts) > 1 and encoded.header.num_parts == len(encoded.parts)
    for part in encoded.parts:
        assert len(part.buffer) <= 65536
        assert deserialize_torch_tensor(part).numel() == part.size[0]  # hivemind reads every part


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize(("name", "params"), ALL_CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_floating_dtypes_come_back_in_their_dtype(name, params, dtype):
    tensor = transformer_activations().to(dtype)
    encoded = encode(tensor, name, **params)
    restored = decode(encoded)
    assert restored.dtype == dtype and encoded.header.dtype == str(dtype).removeprefix("torch.")
    bound = {"none": 0.0, "fp16": 1e-3, "int8": 0.02, "int4": 0.12, "topk": 1.0}[name]
    assert relative_l2(restored, tensor) <= bound
    if name in ("none", "fp16") and dtype != torch.float64:
        assert torch.equal(restored, tensor)  # 16-bit values are sent as their own bits


@pytest.mark.parametrize(("name", "params"), ALL_CODECS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_non_floating_tensors_pass_through_losslessly_as_none(name, params, dtype):
    """Policy: lossy codecs never refuse token ids or masks; they delegate to "none"."""
    tensor = torch.randint(0, 2 if dtype == torch.bool else 50_000, (16, 128)).to(dtype)
    encoded = encode(tensor, name, **params)
    assert encoded.header.codec == "none"
    restored = decode(encoded)
    assert restored.dtype == dtype and torch.equal(restored, tensor)


def test_unsupported_inputs_raise_codec_error():
    with pytest.raises(CodecError):
        encode(torch.randn(3, dtype=torch.complex64), "fp16")
    with pytest.raises(CodecError):
        encode([1.0, 2.0], "none")
    with pytest.raises(CodecError):
        encode(torch.randn(4, 4).to_sparse(), "none")


def test_encode_detaches_and_does_not_touch_the_input():
    tensor = torch.randn(100, requires_grad=True)
    before = tensor.detach().clone()
    for name, params in ALL_CODECS:
        restored = decode(encode(tensor * 1.0, name, **params))
        assert not restored.requires_grad
    assert torch.equal(tensor.detach(), before)


def test_non_finite_values_survive_fp16_and_make_int8_fall_back_to_fp16():
    tensor = torch.tensor([1.0, float("inf"), -2.0, float("nan"), 3.0, float("-inf")])
    restored = decode(encode(tensor, "fp16"))
    assert torch.equal(restored.isnan(), tensor.isnan())
    assert torch.equal(restored[~tensor.isnan()], tensor[~tensor.isnan()])
    for name in ("int8", "int4"):
        lossy = encode(tensor, name)
        assert lossy.header.codec == "fp16"
        assert torch.equal(decode(lossy).isinf(), tensor.isinf())


# ---------------------------------------------------------------- strict decoding


def _replace_part(encoded: EncodedTensor, index: int, **changes) -> EncodedTensor:
    parts = list(encoded.parts)
    part = runtime_pb2.Tensor()
    part.CopyFrom(parts[index])
    for field_name, value in changes.items():
        if field_name == "size":
            del part.size[:]
            part.size.extend(value)
        else:
            setattr(part, field_name, value)
    parts[index] = part
    return EncodedTensor(encoded.header, tuple(parts))


def _with_header(encoded: EncodedTensor, **changes) -> EncodedTensor:
    header = TensorHeader.from_dict({**encoded.header.to_dict(), **changes})
    return EncodedTensor(header, encoded.parts[: header.num_parts])


@pytest.mark.parametrize(("name", "params"), ALL_CODECS)
def test_truncated_or_inconsistent_parts_raise_codec_error(name, params):
    encoded = get_codec(name, max_part_bytes=SMALL_PARTS, **params).encode(random_normal(shape=(50, 100)))
    last = len(encoded.parts) - 1
    broken = [
        _replace_part(encoded, 0, buffer=encoded.parts[0].buffer[:-1]),
        _replace_part(encoded, last, buffer=encoded.parts[last].buffer + b"\0"),
        _replace_part(encoded, 0, size=[encoded.parts[0].size[0] + 1]),
        _replace_part(encoded, 0, size=[2, encoded.parts[0].size[0] // 2]),
        _replace_part(encoded, 0, dtype="float64"),
        _replace_part(encoded, 0, requires_grad=True),
        _replace_part(encoded, 0, compression=runtime_pb2.FLOAT16),
        _with_header(encoded, num_parts=last),  # a missing part
        _with_header(encoded, shape=[50, 99]),
        _with_header(encoded, dtype="int64"),
        _with_header(encoded, codec="none" if name != "none" else "fp16"),
        _with_header(encoded, params={**encoded.header.params, "extra": 1}),
        EncodedTensor(
            TensorHeader.from_dict({**encoded.header.to_dict(), "num_parts": last + 2}),
            encoded.parts + (encoded.parts[-1],),
        ),
    ]
    for bad in broken:
        with pytest.raises(CodecError):
            decode(bad)


def test_a_huge_header_with_tiny_parts_is_rejected_before_allocating():
    part = encode(torch.randn(1), "none").parts[0]
    for codec, params in (("none", {}), ("fp16", {"exponent": 0}), ("int4", {"block": 64, "exponent": 0})):
        forged = EncodedTensor(TensorHeader(codec, (MAX_NUMEL,), "float32", 1, params), (part,))
        with pytest.raises(CodecError):
            decode(forged)


def test_topk_rejects_unsorted_duplicate_or_out_of_range_indices():
    encoded = TopKCodec(0.5).encode(torch.arange(1.0, 9.0))  # k=4, indices [4, 5, 6, 7]
    values, indices = encoded.parts
    for bad in ([5, 4, 6, 7], [4, 4, 6, 7], [4, 5, 6, 8], [-1, 5, 6, 7]):
        forged = runtime_pb2.Tensor()
        forged.CopyFrom(indices)
        forged.buffer = torch.tensor(bad, dtype=torch.int32).numpy().tobytes()
        with pytest.raises(CodecError, match="indices"):
            decode(EncodedTensor(encoded.header, (values, forged)))
    for params in ({"k": 9, "exponent": 0}, {"k": 4, "exponent": 500}, {"k": 4.0, "exponent": 0}, {"k": 4}):
        with pytest.raises(CodecError):
            decode(_with_header(encoded, params=params))


def test_encoded_tensor_checks_its_part_count():
    encoded = encode(torch.randn(10), "none")
    with pytest.raises(CodecError):
        EncodedTensor(encoded.header, ())
    with pytest.raises(CodecError):
        EncodedTensor(encoded.header, (b"not a tensor",))


# ---------------------------------------------------------------- headers and registry


def test_header_round_trips_through_a_dict():
    encoded = encode(torch.randn(3, 4, dtype=torch.bfloat16), "topk", fraction=0.5)
    header = TensorHeader.from_dict(encoded.header.to_dict())
    assert header == encoded.header and header.shape == (3, 4) and header.dtype == "bfloat16"
    newer_peer = {**encoded.header.to_dict(), "added_in_a_later_version": True}
    assert TensorHeader.from_dict(newer_peer) == encoded.header


VALID_HEADER = {"codec": "fp16", "shape": [2, 3], "dtype": "float32", "num_parts": 1, "params": {"exponent": 0}}


@pytest.mark.parametrize(
    "changes",
    [
        {"codec": ""},
        {"codec": 7},
        {"codec": "x" * 65},
        {"shape": "2,3"},
        {"shape": [2, -3]},
        {"shape": [2, 3.0]},
        {"shape": [True, 3]},
        {"shape": [1] * 33},
        {"shape": [MAX_NUMEL, 2]},
        {"dtype": "complex64"},
        {"dtype": None},
        {"num_parts": -1},
        {"num_parts": "1"},
        {"num_parts": 10**9},
        {"params": []},
        {"params": {"exponent": [1]}},
        {"params": {"exponent": float("nan")}},
        {"params": {1: 0}},
        {"params": {f"p{i}": i for i in range(17)}},
    ],
)
def test_malformed_headers_raise_codec_error(changes):
    with pytest.raises(CodecError):
        TensorHeader.from_dict({**VALID_HEADER, **changes})


def test_headers_missing_fields_or_not_dicts_raise_codec_error():
    for bad in (None, [], "header", {k: v for k, v in VALID_HEADER.items() if k != "dtype"}):
        with pytest.raises(CodecError):
            TensorHeader.from_dict(bad)


def test_registry_names_codecs_and_rejects_unknown_ones():
    assert known_codecs() == ["none", "fp16", "int8", "int4", "topk"]
    assert isinstance(get_codec("none"), NoneCodec)
    assert isinstance(get_codec("int8"), BlockwiseInt8Codec)
    assert get_codec("topk", fraction=0.2).params == {"fraction": 0.2}
    with pytest.raises(UnknownCodecError, match="none, fp16, int8, int4, topk"):
        get_codec("zstd")
    with pytest.raises(CodecError):
        get_codec("none", fraction=0.1)
    for fraction in (0.0, 1.5, -0.1, float("nan"), "0.1", True):
        with pytest.raises(CodecError):
            get_codec("topk", fraction=fraction)
    with pytest.raises(CodecError):
        get_codec("none", max_part_bytes=100)
    encoded = encode(torch.randn(4), "none")
    with pytest.raises(UnknownCodecError):
        decode(EncodedTensor(TensorHeader.from_dict({**encoded.header.to_dict(), "codec": "zstd"}), encoded.parts))


def test_a_codec_refuses_to_decode_another_codecs_tensor():
    with pytest.raises(CodecError):
        Float16Codec().decode(encode(torch.randn(4), "none"))


def test_int8_warm_up_reports_seconds():
    assert 0 <= BlockwiseInt8Codec.warm_up() < 30


# ---------------------------------------------------------------- error feedback


def test_error_feedback_makes_the_sum_of_sent_gradients_track_the_true_sum():
    gradient = random_normal(shape=(100, 100), seed=1)
    codec = TopKCodec(0.01)
    feedback = ErrorFeedback()
    sent_with, sent_without = torch.zeros_like(gradient), torch.zeros_like(gradient)
    errors_with = {}
    for step in range(1, 401):
        sent_with += decode(feedback.compress("link-a", gradient, codec))
        sent_without += decode(codec.encode(gradient))
        if step in (100, 400):
            errors_with[step] = relative_l2(sent_with, gradient * step)
    error_without = relative_l2(sent_without, gradient * 400)
    assert error_without > 0.9  # top-1% alone keeps sending the same few values
    # With feedback the error is one bounded residual, so the relative error falls like 1/steps.
    assert errors_with[400] < 0.15 and errors_with[400] < errors_with[100] / 3
    gap = float((sent_with - gradient * 400).norm())
    assert gap == pytest.approx(feedback.residual_norm("link-a"), rel=1e-3)


def test_error_feedback_keys_shapes_and_non_finite_residuals():
    feedback = ErrorFeedback()
    codec = TopKCodec(0.1)
    tensor = torch.randn(50)
    before = tensor.clone()
    feedback.compress(("link", 0), tensor, codec)
    feedback.compress(("link", 1), tensor, codec)
    assert torch.equal(tensor, before)  # the caller's tensor is never modified
    assert len(feedback) == 2 and feedback.residual_norm(("link", 0)) > 0
    reshaped = decode(feedback.compress(("link", 0), torch.randn(5, 10), codec))  # shape change resets
    assert reshaped.shape == (5, 10)
    feedback.compress(("link", 1), torch.full((50,), float("nan")), codec)  # a nan residual is dropped
    assert feedback.residual_norm(("link", 1)) == 0.0 and len(feedback) == 1
    feedback.compress("ids", torch.arange(10), codec)  # integers: encoded as "none", no residual
    assert len(feedback) == 1
    feedback.reset(("link", 0))
    assert len(feedback) == 0
    feedback.compress("x", torch.randn(3, dtype=torch.bfloat16), codec)
    feedback.reset()
    assert len(feedback) == 0


# ---------------------------------------------------------------- accounting


def test_byte_counter_counts_per_codec_across_threads():
    counter = ByteCounter()
    fp16 = encode(torch.randn(1000), "fp16")
    none = encode(torch.randn(10), "none")

    def send_many():
        for _ in range(500):
            counter.record_sent(fp16)

    threads = [threading.Thread(target=send_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counter.record_received(none)
    snapshot = counter.snapshot()
    assert snapshot["sent"] == {"fp16": {"tensors": 2000, "wire_bytes": 2000 * 2000, "original_bytes": 2000 * 4000}}
    assert snapshot["received"] == {"none": {"tensors": 1, "wire_bytes": 40, "original_bytes": 40}}
    forged = EncodedTensor(TensorHeader("made-up", (0,), "float32", 0, {}), ())
    with pytest.raises(UnknownCodecError):
        counter.record_received(forged)


def test_compression_is_a_leaf_package():
    """Peers import wire.compression; it must not pull in the trainer or other project packages."""
    import ast
    import pathlib

    import wire.compression

    package = pathlib.Path(wire.compression.__file__).parent
    project_roots = {"swarm", "peers", "dht", "models"}
    for module in package.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] in project_roots:
                    assert name.startswith("wire.compression"), f"{module.name} imports {name}"


@pytest.mark.parametrize(
    ("low", "high", "dtype", "wire_bytes"),
    [
        (0, 255, torch.int64, 1),  # a byte-level vocabulary: one byte an id
        (0, 50_256, torch.int64, 2),  # GPT-2's vocabulary: two
        (-5, 40_000, torch.int32, 2),
        (0, 2**40, torch.int64, 8),  # nothing narrower holds it: sent as it is
        (7, 7, torch.int16, 1),
    ],
)
def test_integer_tensors_travel_in_the_narrowest_type_and_come_back_exact(low, high, dtype, wire_bytes):
    values = torch.tensor([low, high, (low + high) // 2, low, high], dtype=dtype).reshape(5, 1)
    encoded = get_codec("none").encode(values)
    assert sum(len(part.buffer) for part in encoded.parts) == wire_bytes * values.numel()
    back = decode(encoded)
    assert back.dtype == dtype and torch.equal(back, values)


def test_a_narrowed_header_that_cannot_be_undone_is_refused():
    encoded = get_codec("none").encode(torch.tensor([0, 300], dtype=torch.int64))
    assert encoded.header.params == {"narrow": "int16", "offset": 32768}  # sent as id - 32768
    for params in (
        {"narrow": "float32", "offset": 0},  # not an integer type
        {"narrow": "int64", "offset": 0},  # no narrower than int64
        {"narrow": "int16", "offset": 2**63},  # out of range
        {"narrow": "int16"},  # the offset missing
    ):
        with pytest.raises(CodecError):
            decode(_with_header(encoded, params=params))
    as_int16 = get_codec("none").encode(torch.tensor([0, 200], dtype=torch.int16))
    with pytest.raises(CodecError, match="do not fit int16"):
        decode(_with_header(as_int16, params={"narrow": "uint8", "offset": 32_700}))
