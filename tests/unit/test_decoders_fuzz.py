"""Property tests of every decoder and record parser a peer or trainer runs on bytes from others:
random, truncated or structurally wrong input yields the parser's typed error, never a crash
(issue #11). The tensor codecs themselves are fuzzed in test_codecs_properties.py."""

from __future__ import annotations

import hashlib
import io
import os

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.keys import parse_peer_subkey
from dht.records import PeerRecord, PeerState, SplitRecord, parse_records, parse_split_records
from dht.signing import owned_entries
from peers.compute.checkpoint import MAGIC, CheckpointError, CheckpointMeta, deserialize_state, serialize_state
from wire.compression import TensorHeader
from wire.compression.base import MAX_NDIM
from wire.protocol import (
    CommitRequest,
    CommitResponse,
    ProbeRequest,
    ProbeResponse,
    ProtocolError,
    RequestHeader,
    ResponseHeader,
    StateHeader,
    StateRequest,
    decode_header,
    encode_header,
)
from wire.tensors import decode_tensors, encode_tensor, group_parts

FUZZ = settings(
    max_examples=int(os.environ.get("SWARM_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
HEADERS = [
    RequestHeader,
    ResponseHeader,
    CommitRequest,
    CommitResponse,
    StateRequest,
    StateHeader,
    ProbeRequest,
    ProbeResponse,
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=40),
)
json_like = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=20,
)


def valid_request() -> RequestHeader:
    tensors = {"inputs": torch.randn(2, 4, 8), "targets": torch.randint(0, 9, (2, 4))}
    return RequestHeader(
        rpc="backward",
        model="tiny",
        stage=1,
        num_stages=2,
        microbatch_id="r:0:1",
        batch_size=2,
        tensors={name: encode_tensor(tensor).header for name, tensor in tensors.items()},
        response_codec="int8",
    )


# --- wire headers ----------------------------------------------------------------------------------


@FUZZ
@given(cls=st.sampled_from(HEADERS), data=st.binary(max_size=512))
def test_random_bytes_as_a_header_give_a_protocol_error(cls, data):
    try:
        decode_header(cls, data)
    except ProtocolError:
        pass


@FUZZ
@given(cut=st.integers(min_value=0), flip=st.integers(min_value=0), bit=st.integers(0, 7))
def test_truncated_or_flipped_headers_give_a_protocol_error(cut, flip, bit):
    data = bytearray(encode_header(valid_request()))
    truncated = bytes(data[: cut % len(data)])
    data[flip % len(data)] ^= 1 << bit
    for candidate in (truncated, bytes(data)):
        try:
            header = decode_header(RequestHeader, candidate)
        except ProtocolError:
            continue
        assert isinstance(header, RequestHeader)


@FUZZ
@given(cls=st.sampled_from(HEADERS), value=json_like)
def test_any_msgpack_value_as_a_header_gives_a_protocol_error_or_a_valid_header(cls, value):
    try:
        header = decode_header(cls, msgpack.packb(value, use_bin_type=True))
    except ProtocolError:
        return
    assert isinstance(header, cls)


@FUZZ
@given(
    fields=st.dictionaries(
        st.sampled_from(
            [
                "rpc",
                "model",
                "stage",
                "num_stages",
                "microbatch_id",
                "batch_size",
                "tensors",
                "response_codec",
                "response_codec_params",
            ]
        ),
        json_like,
    )
)
def test_request_headers_with_wrong_field_types_give_a_protocol_error(fields):
    raw = {**valid_request().model_dump(mode="json"), **fields}
    try:
        decode_header(RequestHeader, msgpack.packb(raw, use_bin_type=True))
    except ProtocolError:
        pass


# --- tensors: headers + parts ----------------------------------------------------------------------

metas = st.builds(
    lambda name, codec, shape, dtype, num_parts, params: dict(
        name=name, codec=codec, shape=shape, dtype=dtype, num_parts=num_parts, params=params
    ),
    st.sampled_from(["inputs", "targets", "grad_outputs", "x"]),
    st.sampled_from(["none", "fp16", "int8", "int4", "topk", "zz"]),
    st.lists(st.integers(-2, 9), max_size=4),
    st.sampled_from(["float32", "int64", "float16", "bfloat16", "bogus"]),
    st.integers(0, 3),
    st.dictionaries(
        st.sampled_from(["fraction", "exponent", "blocksize", "block", "q"]),
        st.one_of(st.integers(-5, 5000), st.floats(), st.text(max_size=5)),
        max_size=3,
    ),
)
parts = st.lists(
    st.builds(
        lambda buffer, dtype, size: runtime_pb2.Tensor(buffer=buffer, dtype=dtype, size=size),
        st.binary(max_size=256),
        st.sampled_from(["", "float32", "float16", "int64", "uint8", "junk"]),
        st.lists(st.integers(0, 64), max_size=3),
    ),
    max_size=6,
)


@FUZZ
@given(raw_metas=st.lists(metas, max_size=4), raw_parts=parts)
def test_random_tensor_metas_and_parts_give_a_protocol_error_or_tensors_of_the_stated_shape(raw_metas, raw_parts):
    try:
        header = decode_header(
            RequestHeader,
            msgpack.packb({**valid_request().model_dump(mode="json"), "tensors": raw_metas}, use_bin_type=True),
        )
        decoded = decode_tensors(group_parts(header.tensors, raw_parts))
    except ProtocolError:
        return
    for name, tensor_header in header.tensors.items():
        assert tuple(decoded[name].shape) == tensor_header.shape


@FUZZ
@given(cut=st.integers(0, 200), data=st.data())
def test_truncated_tensor_parts_give_a_protocol_error(cut, data):
    codec = data.draw(st.sampled_from(["none", "fp16", "int8", "int4", "topk"]))
    encoded = {"inputs": encode_tensor(torch.randn(3, 5), codec), "targets": encode_tensor(torch.randint(0, 9, (3,)))}
    headers = {name: item.header for name, item in encoded.items()}
    wire_parts = [part for item in encoded.values() for part in item.parts]
    index = data.draw(st.integers(0, len(wire_parts) - 1))
    damaged = list(wire_parts)
    damaged[index] = runtime_pb2.Tensor(
        buffer=damaged[index].buffer[:cut], dtype=damaged[index].dtype, size=damaged[index].size
    )
    try:
        decode_tensors(group_parts(headers, damaged))
    except ProtocolError:
        pass


def test_a_tensor_header_is_strict_in_code_and_on_the_wire():
    with pytest.raises(ValueError):
        TensorHeader(codec="none", shape=(1,) * (MAX_NDIM + 1), dtype="float32", num_parts=1)
    too_deep = {"name": "x", "codec": "none", "shape": [1] * (MAX_NDIM + 1), "dtype": "float32", "num_parts": 1}
    raw = {**valid_request().model_dump(mode="json"), "tensors": [{**too_deep, "params": {}}]}
    with pytest.raises(ProtocolError, match="MAX|at most"):
        decode_header(RequestHeader, msgpack.packb(raw, use_bin_type=True))


# --- DHT records -----------------------------------------------------------------------------------

record_fields = st.fixed_dictionaries(
    {},
    optional={
        "peer_id": st.one_of(st.text(max_size=130), scalars),
        "model": st.one_of(st.just("tiny"), scalars),
        "stage": st.one_of(st.integers(-1, 3), scalars),
        "num_stages": st.one_of(st.integers(0, 3), scalars),
        "state": st.one_of(st.sampled_from([s.value for s in PeerState]), scalars),
        "throughput": st.one_of(st.floats(), scalars),
        "load": scalars,
        "version": scalars,
        "protocol": scalars,
        "expires_at": st.one_of(st.floats(), scalars),
        "metrics_addr": scalars,
        "averaging": scalars,
        "boundaries": st.one_of(st.lists(st.integers(-1, 9), max_size=5), scalars),
        "since": scalars,
        "active": scalars,
        "unknown_future_field": json_like,
    },
)


@FUZZ
@given(value=st.one_of(json_like, record_fields))
def test_any_dht_value_parses_as_a_record_or_gives_a_value_error(value):
    for cls in (PeerRecord, SplitRecord):
        try:
            cls.from_wire(value)
        except ValueError:
            pass


@FUZZ
@given(
    entries=st.dictionaries(
        st.one_of(st.text(max_size=20), st.binary(max_size=60), st.integers()),
        st.one_of(json_like, record_fields),
        max_size=5,
    )
)
def test_record_readers_skip_whatever_is_malformed(entries):
    for record in parse_records(entries, model="tiny", stage=0):
        assert record.model == "tiny" and record.stage == 0
    parse_split_records(entries, model="tiny")
    assert owned_entries(entries, what="fuzz") == {}  # none of these subkeys carries a key that hashes to its id


@FUZZ
@given(
    subkey=st.one_of(st.binary(max_size=200), st.text(max_size=50), st.integers(), st.none()),
    prefix=st.binary(max_size=60),
)
def test_subkeys_parse_or_are_refused(subkey, prefix):
    for candidate in (subkey, prefix + b"[owner:" + (subkey if isinstance(subkey, bytes) else b"x") + b"]"):
        parsed = parse_peer_subkey(candidate)
        if parsed is not None:
            peer_id, key = parsed
            assert isinstance(peer_id, str) and isinstance(key, bytes)
        owned_entries({candidate: {}} if candidate is not None else {}, what="fuzz")


# --- checkpoints and state transfer ---------------------------------------------------------------


def a_checkpoint() -> bytes:
    module = {"w": torch.randn(4, 3)}
    optimizer = {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
    return serialize_state(CheckpointMeta(model="tiny", stage=0, num_stages=2, steps_done=3), module, optimizer)


CHECKPOINT = a_checkpoint()


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_are_not_a_checkpoint(data):
    for candidate in (data, MAGIC + data):
        with pytest.raises(CheckpointError):
            deserialize_state(candidate)


@FUZZ
@given(cut=st.integers(min_value=0), flip=st.integers(min_value=0), bit=st.integers(0, 7))
def test_truncated_or_flipped_checkpoints_are_refused(cut, flip, bit):
    with pytest.raises(CheckpointError):
        deserialize_state(CHECKPOINT[: cut % len(CHECKPOINT)])
    damaged = bytearray(CHECKPOINT)
    damaged[flip % len(damaged)] ^= 1 << bit
    with pytest.raises(CheckpointError):
        deserialize_state(bytes(damaged))


@FUZZ
@given(payload=st.one_of(st.binary(max_size=300), json_like))
def test_payloads_with_a_valid_checksum_but_a_wrong_layout_are_refused(payload):
    """What a malicious replica could send a joining peer: correctly framed, wrong content."""
    if not isinstance(payload, bytes):
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        payload = buffer.getvalue()
    with pytest.raises(CheckpointError):
        deserialize_state(MAGIC + hashlib.sha256(payload).digest() + payload)


def test_a_pickle_that_would_run_code_is_refused():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    buffer = io.BytesIO()
    torch.save({"meta": {}, "module": Evil(), "optimizer": {}}, buffer)
    payload = buffer.getvalue()
    with pytest.raises(CheckpointError):
        deserialize_state(MAGIC + hashlib.sha256(payload).digest() + payload)
