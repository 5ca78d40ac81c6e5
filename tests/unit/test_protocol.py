"""The wire contract without a network: headers, tensor packing, refusals."""

import asyncio

import msgpack
import pytest
import torch

from wire.compression import TensorHeader
from wire.messages import read_request, write_request
from wire.protocol import ProtocolError, RequestHeader, ResponseHeader, decode_header, encode_header
from wire.tensors import encode_tensor, group_parts


def a_request(**changes) -> RequestHeader:
    fields = dict(rpc="forward", model="tiny", stage=1, num_stages=2, microbatch_id="a:0:1", batch_size=2)
    return RequestHeader(**{**fields, **changes})


def through_the_wire(named, codec="none"):
    """(name, tensor) pairs sent as a request and read back: the request as received."""
    encoded = [(name, encode_tensor(tensor, codec)) for name, tensor in named]
    return asyncio.run(read_request(write_request(a_request(), encoded), RequestHeader))


def test_tensors_round_trip_through_parts_with_each_codec():
    x = torch.randn(3, 64, 32)
    tokens = torch.randint(0, 256, (3, 64))
    for codec, tolerance in [("none", 0.0), ("fp16", 1e-3), ("int8", 0.05)]:
        out = through_the_wire([("inputs", x), ("targets", tokens)], codec).decoded()
        assert torch.equal(out["targets"], tokens)  # token ids are never compressed
        assert ((out["inputs"] - x).norm() / x.norm()).item() <= tolerance
    request = through_the_wire([("inputs", torch.randn(512, 1024))])  # 2 MiB: streamed in parts
    assert len(request.parts) > 1


def test_headers_round_trip_and_malformed_headers_are_refused():
    header = a_request(tensors={"inputs": encode_tensor(torch.zeros(2, 3)).header}, response_codec="int8")
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
    encoded = encode_tensor(torch.zeros(2, 3))
    parts = list(encoded.parts)
    unknown = {"inputs": TensorHeader.from_dict({**encoded.header.to_dict(), "codec": "zstd"})}
    with pytest.raises(ProtocolError, match="zstd.*none"):
        group_parts(unknown, parts)
    with pytest.raises(ProtocolError, match="parts"):
        group_parts({"inputs": encoded.header}, parts + parts)
    twice = {**a_request().model_dump(mode="json"), "tensors": [{"name": "inputs", **encoded.header.to_dict()}] * 2}
    with pytest.raises(ProtocolError, match="twice"):
        decode_header(RequestHeader, msgpack.packb(twice))
