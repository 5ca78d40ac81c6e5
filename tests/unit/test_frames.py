"""The data plane's framing (wire/frames.py): messages round-trip with their parts' bytes as they
were, and every frame a receiver reads from others is refused with a ProtocolError (never anything
else) when its prefix declares more than the limits, its header is malformed or its parts' lengths
do not add up. Random, truncated and corrupted frames are fuzzed."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.bounded_streams import MessageTooLargeError
from wire.frames import (
    CALL,
    END,
    END_FRAME,
    ERROR,
    HELLO,
    MAX_FRAME_HEADER_BYTES,
    MAX_FRAME_PARTS,
    MESSAGE,
    PREFIX,
    call_frame,
    error_frame,
    hello_frame,
    message_frame,
    parse_header,
    parse_prefix,
    to_message,
)
from wire.messages import read_request, request_messages
from wire.protocol import MAX_HEADER_BYTES, ProtocolError, RequestHeader
from wire.tensors import decode_tensors, encode_tensor

FUZZ = settings(
    max_examples=int(os.environ.get("SWARM_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
LIMIT = 4 << 20


def read_frames(data: bytes, message_type=runtime_pb2.ExpertRequest, limit: int = LIMIT) -> list:
    """Every frame in `data`, as a receiver reads them: (kind, header, message or None)."""
    frames, at = [], 0
    while at < len(data):
        if len(data) - at < PREFIX.size:
            raise ProtocolError("a truncated frame")
        kind, header_len, payload_len = parse_prefix(data[at : at + PREFIX.size], limit)
        at += PREFIX.size
        if len(data) - at < header_len + payload_len:
            raise ProtocolError("a truncated frame")
        header = parse_header(data[at : at + header_len], payload_len)
        at += header_len
        payload = data[at : at + payload_len]
        at += payload_len
        frames.append((kind, header, to_message(header, payload, message_type) if kind == MESSAGE else None))
    return frames


def a_request() -> list[runtime_pb2.ExpertRequest]:
    """A real forward request's messages (wire/messages.py), tensors of two codecs and dtypes."""
    inputs = encode_tensor(torch.randn(2, 8, 16), "int8", max_part_bytes=8192)
    tokens = encode_tensor(torch.randint(0, 50, (2, 8)))
    header = RequestHeader(
        rpc="forward",
        model="tiny",
        stage=1,
        num_stages=2,
        microbatch_id="m:1",
        batch_size=2,
        tensors={"inputs": inputs.header, "tokens": tokens.header},
    )
    return list(request_messages(header, [*inputs.parts, *tokens.parts]))


def test_a_request_round_trips_through_frames_with_its_tensors_intact():
    messages = a_request()
    data = b"".join([call_frame("swarm.forward"), *(b for m in messages for b in message_frame(m)), END_FRAME])
    frames = read_frames(data)
    assert [kind for kind, _, _ in frames] == [CALL, *([MESSAGE] * len(messages)), END]
    assert frames[0][1].rpc == "swarm.forward"
    received = [message for _, _, message in frames[1:-1]]
    for message in messages:
        message.ClearField("uid")  # only for captures of p2pd traffic: the data plane names the call once, in CALL
    assert [m.SerializeToString() for m in received] == [m.SerializeToString() for m in messages]

    async def read():
        async def stream():
            for message in received:
                yield message

        return await read_request(stream(), RequestHeader)

    request = asyncio.run(read())
    decoded = decode_tensors(request.encoded())
    assert decoded["tokens"].dtype == torch.int64 and decoded["inputs"].shape == (2, 8, 16)


def test_a_message_frame_sends_each_part_as_its_own_buffer():
    message = runtime_pb2.ExpertRequest(
        metadata=b"h", tensors=[runtime_pb2.Tensor(buffer=b"a" * 10, dtype="uint8", size=[10])] * 2
    )
    buffers = message_frame(message)
    assert buffers[1:] == [b"a" * 10, b"a" * 10]  # the parts' bytes, not joined into a new buffer


def test_hello_and_error_frames_carry_their_fields():
    (kind, header, _), (error_kind, error_header, _) = read_frames(
        hello_frame("t" * 32) + error_frame(ERROR, "x" * 9000)
    )
    assert (kind, header.token) == (HELLO, "t" * 32)
    assert error_kind == ERROR and len(error_header.error) == 4096


@pytest.mark.parametrize(
    "prefix, error",
    [
        (PREFIX.pack(MESSAGE, 0, LIMIT + 1), MessageTooLargeError),  # refused before the body is read
        (PREFIX.pack(MESSAGE, MAX_FRAME_HEADER_BYTES + 1, 0), MessageTooLargeError),
        (PREFIX.pack(99, 0, 0), ProtocolError),  # an unknown kind
        (PREFIX.pack(END, 0, 10), ProtocolError),  # only a message carries a payload
    ],
)
def test_a_prefix_past_the_limits_is_refused_before_the_rest(prefix, error):
    with pytest.raises(error):
        parse_prefix(prefix, LIMIT)
    assert issubclass(error, ProtocolError)


@pytest.mark.parametrize(
    "fields, payload_len",
    [
        ({"parts": [{"compression": 0, "dtype": "uint8", "size": [4], "nbytes": 4}]}, 5),  # lengths do not add up
        ({"parts": [{"compression": 0, "dtype": "uint8", "size": [4], "nbytes": 4}] * (MAX_FRAME_PARTS + 1)}, 68),
        ({"parts": [{"compression": 0, "dtype": "uint8", "size": [1] * 33, "nbytes": 0}]}, 0),  # too many dims
        ({"parts": [{"compression": 0, "dtype": "uint8", "size": [-1], "nbytes": 0}]}, 0),
        ({"parts": [{"compression": "NONE", "dtype": "uint8", "size": [1], "nbytes": 1}]}, 1),  # strict types
        ({"metadata": b"x" * (MAX_HEADER_BYTES + 1)}, 0),
        ({"rpc": "x" * 65}, 0),
        ({"token": "short"}, 0),
        ({"parts": "everything"}, 0),
    ],
)
def test_a_malformed_header_is_a_protocol_error(fields, payload_len):
    with pytest.raises(ProtocolError):
        parse_header(msgpack.packb(fields, use_bin_type=True), payload_len)


def test_unknown_header_fields_are_ignored_so_a_newer_peer_may_add_some():
    header = parse_header(msgpack.packb({"rpc": "swarm.forward", "priority": 3}), 0)
    assert header.rpc == "swarm.forward"


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_are_refused_with_a_protocol_error(data):
    try:
        read_frames(data)
    except ProtocolError:
        pass


@FUZZ
@given(st.data())
def test_truncated_or_corrupted_frames_are_refused_with_a_protocol_error(data):
    messages = a_request()
    frames = b"".join([call_frame("swarm.forward"), *(b for m in messages for b in message_frame(m)), END_FRAME])
    position = data.draw(st.integers(0, len(frames) - 1))
    if data.draw(st.booleans()):
        frames = frames[:position]
    else:
        frames = frames[:position] + bytes([data.draw(st.integers(0, 255))]) + frames[position + 1 :]
    try:
        read_frames(frames)
    except ProtocolError:
        pass


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["rpc", "metadata", "parts", "token", "error", "other"]),
        st.recursive(
            st.one_of(
                st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=20), st.binary(max_size=20)
            ),
            lambda inner: st.one_of(
                st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=5)
            ),
            max_leaves=12,
        ),
        max_size=5,
    ),
    st.integers(0, 64),
)
def test_random_headers_are_refused_with_a_protocol_error(fields, payload_len):
    try:
        parse_header(msgpack.packb(fields, use_bin_type=True), payload_len)
    except ProtocolError:
        pass
