"""Sizes from headers are checked in bytes, dtype-aware, before anything is read on, allocated or
decoded (issue #30): a top-k header of a few hundred bytes that declares a gigabyte of float64 is
refused at the header, by a peer and by a trainer, with bounded memory."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hivemind.proto import runtime_pb2

from wire.compression import CodecError, EncodedTensor, TensorHeader, decode, encode
from wire.compression.base import MAX_TENSOR_BYTES
from wire.messages import read_request, read_response, request_messages, response_messages
from wire.protocol import ProtocolError, RequestHeader, ResponseHeader
from wire.tensors import DecodedTooLargeError, check_decoded_bytes, decode_tensors, decoded_nbytes

BOMB_NUMEL = MAX_TENSOR_BYTES // 8  # the most float64 values one header may declare: 1 GiB


def topk_bomb(numel: int = BOMB_NUMEL, dtype: str = "float64") -> EncodedTensor:
    """A top-k tensor that keeps nothing of `numel` values: two empty parts, decodes to `numel` zeros."""
    values = runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=b"", size=[0], dtype="float16")
    indices = runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=b"", size=[0], dtype="int32")
    return EncodedTensor(TensorHeader("topk", (numel,), dtype, 2, {"k": 0, "exponent": 0}), (values, indices))


def bomb_request() -> RequestHeader:
    header = RequestHeader(rpc="forward", model="tiny", stage=1, num_stages=2, microbatch_id="m", batch_size=1)
    bomb = topk_bomb()
    return RequestHeader.model_validate({**dict(header), "tensors": {"inputs": bomb.header}}), list(bomb.parts)


async def _messages_then_fail(messages):
    """The first message; reading a second one fails the test (the receiver must stop at the header)."""
    messages = list(messages)
    yield messages[0]
    raise AssertionError("the receiver read past a header it should have refused")


def test_a_header_is_bounded_in_bytes_by_its_dtype():
    TensorHeader("none", (MAX_TENSOR_BYTES // 4,), "float32", 1)  # 2**28 float32 values: at the limit
    with pytest.raises(CodecError, match="MAX_TENSOR_BYTES"):
        TensorHeader("none", (MAX_TENSOR_BYTES // 4,), "float64", 1)  # the same count of float64: twice over
    assert decoded_nbytes([topk_bomb().header, topk_bomb(10, "float16").header]) == MAX_TENSOR_BYTES + 20


def test_check_decoded_bytes_counts_every_tensor():
    headers = [topk_bomb(1000, "float32").header, topk_bomb(1000, "float32").header]
    check_decoded_bytes(headers, 8000)
    check_decoded_bytes(headers, None)
    with pytest.raises(DecodedTooLargeError, match="8000 bytes"):
        check_decoded_bytes(headers, 7999)


def test_decode_tensors_refuses_before_decoding():
    with pytest.raises(DecodedTooLargeError):
        decode_tensors({"inputs": topk_bomb()}, max_bytes=64 << 20)
    small = topk_bomb(16, "float32")
    assert decode_tensors({"inputs": small}, max_bytes=64)["inputs"].abs().sum() == 0


def test_a_peer_refuses_the_bomb_at_the_header_without_reading_on():
    header, parts = bomb_request()
    stream = _messages_then_fail(request_messages(header, parts))
    with pytest.raises(DecodedTooLargeError) as refused:
        asyncio.run(read_request(stream, RequestHeader, max_decoded_bytes=256 << 20))
    assert isinstance(refused.value, ProtocolError)  # answered as a bad request, like any malformed one


def test_a_trainer_refuses_a_bomb_answer_at_the_header():
    bomb = topk_bomb()
    header = ResponseHeader.model_validate({"tensors": {"outputs": bomb.header}})
    stream = _messages_then_fail(response_messages(header, list(bomb.parts)))
    with pytest.raises(DecodedTooLargeError):
        asyncio.run(read_response(stream, ResponseHeader, max_decoded_bytes=8 * 2 * 64 * 32 + (1 << 20)))


_MEASURE = textwrap.dedent(
    """
    import asyncio, resource, sys
    sys.path.insert(0, sys.argv[1])
    from tests.unit.test_size_bombs import bomb_request
    from wire.messages import read_request, request_messages
    from wire.protocol import ProtocolError, RequestHeader

    async def stream(messages):
        for message in messages:
            yield message

    async def serve():  # what a peer's handler does with a request: read it, then decode it
        header, parts = bomb_request()
        request = await read_request(stream(request_messages(header, parts)), RequestHeader,
                                     max_decoded_bytes=LIMIT)
        request.decoded(max_bytes=LIMIT)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        asyncio.run(serve())
        print("decoded")
    except ProtocolError:
        print("refused")
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)


def test_the_bomb_costs_a_peer_no_memory():
    """Measured in a fresh process (peak RSS is per process): a 1 GiB top-k bomb, refused, raises the
    peak by a few MiB at most. (With LIMIT None, the same script decodes it: +1027 MiB measured.)"""
    root = str(Path(__file__).resolve().parents[2])
    script = _MEASURE.replace("LIMIT", str(256 << 20))
    done = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome, grown_mib = done.stdout.split()
    assert outcome == "refused"
    assert int(grown_mib) < 50, f"peak RSS grew by {grown_mib} MiB"


def test_a_joiner_refuses_a_state_larger_than_its_stage_can_take_at_the_header():
    from wire.messages import read_state, write_state
    from wire.protocol import StateHeader

    messages = write_state(StateHeader(total_bytes=1 << 33, steps_done=1), b"")  # announces 8 GiB, sends none
    with pytest.raises(ProtocolError, match="more than such a stage can take"):
        asyncio.run(read_state(_messages_then_fail(messages), sender="abc", max_bytes=100 << 20))


def test_an_int4_header_cannot_declare_more_than_its_parts_carry():
    """int4 sends half a byte per value: a header declaring a gigabyte with a few bytes of parts is
    refused by the decoder (the part lengths are checked before anything is allocated), and a valid
    int4 tensor decodes to at most 16x its payload (float64: 8 bytes from 0.53)."""
    tiny = encode(torch.randn(3), "int4")
    header = TensorHeader("int4", (BOMB_NUMEL,), "float64", 2, {"block": 64, "exponent": 0})
    with pytest.raises(CodecError, match="part"):
        decode(EncodedTensor(header, tiny.parts))
    honest = encode(torch.randn(4096, dtype=torch.float64), "int4")
    assert honest.header.original_nbytes / honest.nbytes <= 16
