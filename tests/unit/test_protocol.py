"""The wire contract without a network: headers, tensor packing, refusals."""

import msgpack
import pytest
import torch

from wire.protocol import (
    ProtocolError,
    RequestHeader,
    ResponseHeader,
    TensorMeta,
    decode_header,
    encode_header,
    from_wire,
    pack_named,
    unpack_named,
)


def test_tensors_round_trip_through_parts_with_each_codec():
    x = torch.randn(3, 64, 32)
    tokens = torch.randint(0, 256, (3, 64))
    for codec, tolerance in [("none", 0.0), ("fp16", 1e-3), ("int8", 0.05)]:
        metas, parts = pack_named([("inputs", x), ("targets", tokens)], codec)
        out = unpack_named(metas, parts)
        assert torch.equal(out["targets"], tokens)  # token ids are never compressed
        assert ((out["inputs"] - x).norm() / x.norm()).item() <= tolerance
    metas, parts = pack_named([("inputs", torch.randn(512, 1024))])  # 2 MiB: streamed in parts
    assert len(parts) > 1


def test_headers_round_trip_and_malformed_headers_are_refused():
    metas, _ = pack_named([("inputs", torch.zeros(2, 3))])
    header = RequestHeader(
        rpc="forward",
        model="tiny",
        stage=1,
        num_stages=2,
        microbatch_id="a:0:1",
        batch_size=2,
        tensors=metas,
        response_codec="int8",
    )
    assert decode_header(RequestHeader, encode_header(header)) == header
    response = ResponseHeader(loss=1.5, error=None)
    assert decode_header(ResponseHeader, encode_header(response)) == response
    for junk in [
        b"",
        b"\xff\x00garbage",
        msgpack.packb({"rpc": "explode"}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({**header.model_dump(mode="json"), "stage": -1}),
    ]:
        with pytest.raises(ProtocolError):
            decode_header(RequestHeader, junk)


def test_unknown_codecs_and_missing_parts_are_refused():
    metas, parts = pack_named([("inputs", torch.zeros(2, 3))])
    unknown = (TensorMeta(**{**metas[0].model_dump(), "codec": "zstd"}),)
    with pytest.raises(ProtocolError, match="zstd.*none"):
        from_wire(unknown, parts)
    with pytest.raises(ProtocolError, match="parts"):
        from_wire(metas, parts + parts)
    with pytest.raises(ProtocolError, match="twice"):
        from_wire(metas + metas, parts + parts)
