"""wire.messages and the unified tensor header without a network: each helper's round trip, the
limits a receiver enforces on a header's tensors, and the one failure vocabulary."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2

from wire.compression import ByteCounter
from wire.compression.base import MAX_NDIM, MAX_NUMEL, MAX_PARAMS, MAX_PARTS
from wire.failures import ANSWERS, Failure, caller_failure
from wire.messages import (
    read_request,
    read_response,
    read_state,
    read_unary,
    unary_request,
    unary_response,
    write_request,
    write_response,
    write_state,
)
from wire.protocol import (
    MAX_TENSOR_NAME_CHARS,
    MAX_TENSORS,
    STATE_CHUNK_BYTES,
    CommitRequest,
    CommitResponse,
    ProtocolError,
    RequestHeader,
    ResponseHeader,
    StateHeader,
    StreamClosedError,
    decode_header,
    encode_header,
)
from wire.request_limits import RequestTooLargeError
from wire.tensors import encode_tensor


def a_request(**changes) -> RequestHeader:
    fields = dict(rpc="backward", model="tiny", stage=1, num_stages=2, microbatch_id="r:0:1", batch_size=3)
    return RequestHeader(**{**fields, **changes})


async def _stream(messages):
    for message in messages:
        yield message


async def _collect(stream) -> list:
    return [message async for message in stream]


def test_a_request_round_trips_through_write_request_and_read_request():
    inputs, targets = torch.randn(3, 256, 1024), torch.randint(0, 9, (3, 256))  # 3 MiB of inputs: several parts
    encoded = [("inputs", encode_tensor(inputs, "fp16")), ("targets", encode_tensor(targets))]
    messages = asyncio.run(_collect(write_request(a_request(response_codec="int8"), encoded)))
    # the inputs' 1.5 MiB cross as two parts; the small targets ride with the second: two messages
    assert len(messages) == 2 and messages[0].uid == "backward" and all(not m.metadata for m in messages[1:])
    assert [len(m.tensors) for m in messages] == [1, 2]

    counter = ByteCounter()
    request = asyncio.run(read_request(_stream(messages), RequestHeader, max_bytes=16 << 20))
    assert request.header == a_request(response_codec="int8", tensors={name: item.header for name, item in encoded}), (
        "the header lists the tensors, in order"
    )
    assert list(request.header.tensors) == ["inputs", "targets"]
    decoded = request.decoded(counter)
    assert torch.allclose(decoded["inputs"], inputs, atol=1e-2) and torch.equal(decoded["targets"], targets)
    received = counter.snapshot()["received"]
    assert received["fp16"]["tensors"] == 1 and received["none"]["wire_bytes"] == encoded[1][1].nbytes


def test_a_response_round_trips_through_write_response_and_read_response_and_counts_what_it_sends():
    outputs = torch.randn(2, 8, 4)
    counter = ByteCounter()
    messages = list(
        write_response(ResponseHeader(loss=0.5, compute_s=0.1), [("outputs", encode_tensor(outputs))], counter)
    )
    assert counter.snapshot()["sent"]["none"]["tensors"] == 1  # counted when the answer is built
    answer = asyncio.run(read_response(_stream(messages), ResponseHeader))
    assert (answer.header.loss, answer.header.compute_s, answer.header.error) == (0.5, 0.1, None)
    assert answer.encoded()["outputs"].header.shape == (2, 8, 4)
    assert torch.equal(answer.decoded()["outputs"], outputs)


def test_an_error_answer_round_trips_with_its_kind_and_a_caller_classifies_it():
    for kind in ANSWERS:
        (message,) = write_response(ResponseHeader(error="no", error_kind=kind))
        answer = asyncio.run(read_response(_stream([message]), ResponseHeader))
        assert answer.header.error_kind is kind and answer.encoded() == {}
    assert caller_failure(Failure.BAD_REQUEST) is Failure.REFUSED
    assert caller_failure(Failure.WRONG_STAGE) is Failure.WRONG_STAGE
    assert caller_failure(Failure.CACHE_MISS) is Failure.CACHE_MISS
    assert caller_failure(Failure.INTERNAL) is caller_failure(None) is Failure.INTERNAL


@pytest.mark.parametrize("kind", ["timeout", "refused", "too_large", "explode", 3, ["bad_request"]])
def test_a_peer_may_only_answer_the_kinds_a_peer_answers(kind):
    raw = {"error": "x", "error_kind": kind}
    with pytest.raises(ProtocolError):
        decode_header(ResponseHeader, msgpack.packb(raw, use_bin_type=True))


def test_failure_values_are_the_labels_metrics_and_reports_show():
    assert {kind.value for kind in Failure} == {
        "bad_request",
        "wrong_stage",
        "internal",
        "cache_miss",
        "too_large",
        "rate_limited",
        "not_allowed",
        "timeout",
        "transport",
        "garbage",
        "refused",
    }


def test_reading_a_stream_enforces_its_limits():
    big = [("inputs", encode_tensor(torch.randn(1024, 1024)))]  # 4 MiB
    with pytest.raises(RequestTooLargeError):
        asyncio.run(read_request(write_request(a_request(), big), RequestHeader, max_bytes=1 << 20))
    with pytest.raises(ProtocolError, match="more than 2 tensor parts"):
        asyncio.run(read_request(write_request(a_request(), big), RequestHeader, max_parts=2))
    with pytest.raises(StreamClosedError):
        asyncio.run(read_request(_stream([]), RequestHeader))
    with pytest.raises(ProtocolError, match="no header"):
        asyncio.run(read_request(_stream([runtime_pb2.ExpertRequest()]), RequestHeader))


def test_a_tensor_sent_twice_is_refused_before_anything_is_sent():
    encoded = encode_tensor(torch.zeros(2))
    with pytest.raises(ProtocolError, match="twice"):
        write_request(a_request(), [("inputs", encoded), ("inputs", encoded)])
    with pytest.raises(ProtocolError, match=f"more than {MAX_TENSORS}"):
        write_request(a_request(), [(f"t{i}", encoded) for i in range(MAX_TENSORS + 1)])


def test_unary_headers_round_trip():
    commit = CommitRequest(model="tiny", stage=0, num_stages=2, step_id="s:1", group_size=2)
    message = unary_request(commit)
    assert message.uid == "commit" and not message.tensors
    assert read_unary(message, CommitRequest) == commit
    answer = CommitResponse(stepped=True, steps_done=4)
    assert read_unary(unary_response(answer), CommitResponse) == answer
    with pytest.raises(ProtocolError):
        read_unary(runtime_pb2.ExpertResponse(metadata=b"\x93junk"), CommitResponse)


def test_the_state_stream_round_trips_and_refuses_what_does_not_add_up():
    data = bytes(range(256)) * (STATE_CHUNK_BYTES // 128 + 3)  # a little over two chunks
    messages = list(write_state(StateHeader(total_bytes=len(data), steps_done=7), data))
    assert len(messages) == 4 and not messages[0].tensors  # the header travels alone
    assert asyncio.run(read_state(_stream(messages), sender="abc")) == data
    with pytest.raises(StreamClosedError, match="ended early"):  # a broken connection: worth asking again
        asyncio.run(read_state(_stream(messages[:-1]), sender="abc"))
    with pytest.raises(StreamClosedError, match=r"ended early \(0 bytes\)"):
        asyncio.run(read_state(_stream([]), sender="abc"))
    with pytest.raises(ProtocolError, match="more state than it announced"):
        asyncio.run(read_state(_stream([*messages, messages[-1]]), sender="abc"))
    with pytest.raises(ProtocolError, match="replica abc refused: busy"):
        asyncio.run(read_state(_stream(write_state(StateHeader(error="busy"), b"")), sender="abc"))


# --- the one tensor header's limits, as a receiver sees them ---------------------------------------

GOOD = {"name": "inputs", "codec": "none", "shape": [2, 3], "dtype": "float32", "num_parts": 1, "params": {}}


def _decode_with(*entries) -> RequestHeader:
    raw = {**a_request().model_dump(mode="json"), "tensors": list(entries)}
    return decode_header(RequestHeader, msgpack.packb(raw, use_bin_type=True))


def test_a_well_formed_tensor_header_decodes_and_unknown_fields_are_ignored():
    header = _decode_with(GOOD, {**GOOD, "name": "targets", "added_later": 1})
    assert list(header.tensors) == ["inputs", "targets"]
    assert header.tensors["inputs"].shape == (2, 3) and header.tensors["inputs"].numel == 6
    assert decode_header(RequestHeader, encode_header(header)) == header


@pytest.mark.parametrize(
    "changes",
    [
        {"shape": [1] * (MAX_NDIM + 1)},
        {"shape": [MAX_NUMEL, 2]},
        {"shape": [-1]},
        {"shape": [2.0]},
        {"shape": "2,3"},
        {"num_parts": MAX_PARTS + 1},
        {"num_parts": True},
        {"dtype": "complex64"},
        {"codec": ""},
        {"codec": "x" * 65},
        {"params": {f"p{i}": i for i in range(MAX_PARAMS + 1)}},
        {"params": {"fraction": math.nan}},
        {"params": {"k": [1]}},
        {"params": None},
        {"name": "n" * (MAX_TENSOR_NAME_CHARS + 1)},
        {"name": 3},
        {"name": None},
    ],
)
def test_a_malformed_tensor_header_is_a_protocol_error(changes):
    with pytest.raises(ProtocolError):
        _decode_with({**GOOD, **changes})


@pytest.mark.parametrize(
    "tensors",
    [
        [GOOD] * 2,  # the same name twice
        [{**GOOD, "name": f"t{i}"} for i in range(MAX_TENSORS + 1)],
        ["inputs"],
        {"inputs": GOOD},
        [{k: v for k, v in GOOD.items() if k != "dtype"}],
    ],
)
def test_a_malformed_tensor_list_is_a_protocol_error(tensors):
    raw = {**a_request().model_dump(mode="json"), "tensors": tensors}
    with pytest.raises(ProtocolError):
        decode_header(RequestHeader, msgpack.packb(raw, use_bin_type=True))


def test_small_tensors_travel_with_their_header_in_one_message():
    """A tiny model's request (its token ids and targets) is one message, not one per part; parts
    ride together up to PACKED_BYTES, and a part that large goes alone."""
    from wire.messages import PACKED_BYTES, packed

    tokens, targets = torch.randint(0, 9, (4, 32)), torch.randint(0, 9, (4, 32))
    encoded = [("inputs", encode_tensor(tokens)), ("targets", encode_tensor(targets))]
    messages = asyncio.run(_collect(write_request(a_request(), encoded)))
    assert len(messages) == 1 and len(messages[0].tensors) == 2
    request = asyncio.run(read_request(_stream(messages), RequestHeader))
    assert torch.equal(request.decoded()["inputs"], tokens) and torch.equal(request.decoded()["targets"], targets)

    class Part:
        def __init__(self, n):
            self.buffer = b"x" * n

    sizes = [[len(p.buffer) for p in group] for group in packed([Part(n) for n in (10, PACKED_BYTES, 5, 6)])]
    assert sizes == [[10], [PACKED_BYTES], [5, 6]] and packed([]) == [[]]
