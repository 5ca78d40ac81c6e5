"""The peer's wire contract, in one place: RPC names, typed request/response headers, and how
tensors are packed into a stream of hivemind protobuf messages.

A call is a stream of `ExpertRequest` messages: the first carries the msgpack-encoded
`RequestHeader` in `metadata`; tensor parts (each at most 1 MiB, encoded by the codec the header
names, see `wire.compression`) follow, in the order the header lists the tensors. The answer is
a stream of `ExpertResponse` messages built the same way around a `ResponseHeader`. A peer answers a request it refuses with `ResponseHeader.error` set,
never by dropping the stream, so the trainer can tell a bad request from a dead peer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from enum import Enum
from typing import Literal

import msgpack
import torch
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wire import compression
from wire.request_limits import check_request_bytes

RPC_FORWARD = "swarm.forward"
RPC_BACKWARD = "swarm.backward"
RPC_COMMIT = "swarm.commit"  # sync averaging: the trainer finished a step; replicas average and step
RPC_STATE = "swarm.state"  # a joining replica downloads this stage's parameters and optimizer state
RPC_PROBE = "swarm.probe"  # echo a payload to measure a link (headers in peers/placement/link_probe.py)
STATE_CHUNK_BYTES = 1 << 20
MAX_STATE_BYTES = 1 << 34
MAX_HEADER_BYTES = 64 << 10
MAX_TENSORS = 4


class ProtocolError(ValueError):
    """A message that does not follow the wire contract."""


class StreamClosedError(ProtocolError):
    """The stream ended before any message: the other side closed it or the connection broke."""


class ErrorKind(str, Enum):
    BAD_REQUEST = "bad_request"  # the caller's fault: wrong shape/dtype/stage/codec; do not retry as is
    WRONG_STAGE = "wrong_stage"  # the peer serves another stage now (it moved); refresh the route
    INTERNAL = "internal"  # the peer failed; retry elsewhere
    CACHE_MISS = "cache_miss"  # inputs_cached was set but this peer holds no current forward: resend with inputs


class TensorMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(max_length=32)
    codec: str = Field(max_length=32)
    shape: tuple[int, ...] = Field(max_length=8)
    dtype: str = Field(max_length=16)
    num_parts: int = Field(ge=0, le=1 << 16)
    params: dict[str, int | float | str] = Field(default_factory=dict, max_length=8)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class RequestHeader(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    rpc: Literal["forward", "backward"]
    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    microbatch_id: str = Field(min_length=1, max_length=128)
    batch_size: int = Field(ge=1)
    tensors: tuple[TensorMeta, ...] = Field(max_length=MAX_TENSORS)
    response_codec: str = Field(default="none", max_length=32)  # how the peer should encode what it returns
    response_codec_params: dict[str, int | float | str] = Field(default_factory=dict, max_length=8)
    # backward only: no 'inputs' tensor is sent; use those this peer cached when it served the forward
    inputs_cached: bool = False


class ResponseHeader(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    tensors: tuple[TensorMeta, ...] = Field(default=(), max_length=MAX_TENSORS)
    loss: float | None = None
    compute_s: float = 0.0  # seconds the request ran on the peer's compute thread
    queue_s: float = 0.0  # seconds from its full arrival to the start of that compute (decode, wait)
    error: str | None = Field(default=None, max_length=4096)
    error_kind: ErrorKind | None = None


class CommitRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    step_id: str = Field(min_length=1, max_length=128)
    group_size: int = Field(ge=1, le=4096, description="replicas of this stage the trainer commits to")


class CommitResponse(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    stepped: bool = False
    averaged: bool = False
    group_size: int = 1
    samples: int = 0
    steps_done: int = 0
    error: str | None = Field(default=None, max_length=4096)


class StateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)


class StateHeader(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    total_bytes: int = Field(default=0, ge=0, le=MAX_STATE_BYTES)
    steps_done: int = 0
    error: str | None = Field(default=None, max_length=4096)


def encode_header(header: BaseModel) -> bytes:
    return msgpack.packb(header.model_dump(mode="json"), use_bin_type=True)


def decode_header(cls: type[BaseModel], data: bytes) -> BaseModel:
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
        if isinstance(raw, dict) and "tensors" in raw and isinstance(raw["tensors"], list):
            raw["tensors"] = tuple(
                {**t, "shape": tuple(t["shape"])} if isinstance(t, dict) and isinstance(t.get("shape"), list) else t
                for t in raw["tensors"]
            )
        if isinstance(raw, dict) and raw.get("error_kind") is not None:
            raw["error_kind"] = ErrorKind(raw["error_kind"])
        return cls.model_validate(raw)
    except (ValidationError, ValueError, TypeError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed {cls.__name__}: {e}") from None


# --- tensors <-> parts ---------------------------------------------------------------------------


def encode_tensor(
    tensor: torch.Tensor,
    codec: str = "none",
    params: dict | None = None,
    *,
    feedback: compression.ErrorFeedback | None = None,
    feedback_key=None,
) -> compression.EncodedTensor:
    """Encode one tensor (parts of at most 1 MiB). Integer tensors (token ids) always travel
    losslessly. With `feedback`, what the codec drops is kept and added to the next tensor under
    the same key (error feedback, for top-k gradients)."""
    try:
        codec_impl = compression.get_codec(codec, **(params or {}))
        if feedback is not None and tensor.is_floating_point():
            return feedback.compress(feedback_key, tensor.detach(), codec_impl)
        return codec_impl.encode(tensor.detach())
    except compression.CodecError as e:
        raise ProtocolError(str(e)) from None


def to_wire(
    named: Iterable[tuple[str, compression.EncodedTensor]],
) -> tuple[tuple[TensorMeta, ...], list[runtime_pb2.Tensor]]:
    metas, parts = [], []
    for name, encoded in named:
        h = encoded.header
        metas.append(
            TensorMeta(name=name, codec=h.codec, shape=h.shape, dtype=h.dtype, num_parts=h.num_parts, params=h.params)
        )
        parts.extend(encoded.parts)
    return tuple(metas), parts


def from_wire(metas: tuple[TensorMeta, ...], parts: list[runtime_pb2.Tensor]) -> dict[str, compression.EncodedTensor]:
    """Regroup parts by tensor and validate each header; nothing is decoded yet."""
    expected = sum(m.num_parts for m in metas)
    if len(parts) != expected:
        raise ProtocolError(f"expected {expected} tensor parts in total, got {len(parts)}")
    result, offset = {}, 0
    for meta in metas:
        if meta.name in result:
            raise ProtocolError(f"tensor {meta.name!r} is sent twice")
        try:
            header = compression.TensorHeader(
                codec=meta.codec, shape=meta.shape, dtype=meta.dtype, num_parts=meta.num_parts, params=dict(meta.params)
            )
            if meta.codec not in compression.known_codecs():
                raise compression.UnknownCodecError(meta.codec, compression.known_codecs())
            result[meta.name] = compression.EncodedTensor(header, tuple(parts[offset : offset + meta.num_parts]))
        except compression.CodecError as e:
            raise ProtocolError(f"tensor {meta.name!r}: {e}") from None
        offset += meta.num_parts
    return result


def decode_tensors(encoded: dict[str, compression.EncodedTensor]) -> dict[str, torch.Tensor]:
    decoded = {}
    for name, item in encoded.items():
        try:
            decoded[name] = compression.decode(item)
        except compression.CodecError as e:
            raise ProtocolError(f"tensor {name!r}: {e}") from None
    return decoded


def pack_named(
    tensors: Iterable[tuple[str, torch.Tensor]], codec: str = "none", params: dict | None = None
) -> tuple[tuple[TensorMeta, ...], list[runtime_pb2.Tensor]]:
    return to_wire((name, encode_tensor(tensor, codec, params)) for name, tensor in tensors)


def unpack_named(metas: tuple[TensorMeta, ...], parts: list[runtime_pb2.Tensor]) -> dict[str, torch.Tensor]:
    return decode_tensors(from_wire(metas, parts))


# --- messages ------------------------------------------------------------------------------------


def request_messages(header: RequestHeader, parts: list[runtime_pb2.Tensor]) -> Iterator[runtime_pb2.ExpertRequest]:
    yield runtime_pb2.ExpertRequest(uid=header.rpc, metadata=encode_header(header), tensors=parts[:1])
    for part in parts[1:]:
        yield runtime_pb2.ExpertRequest(tensors=[part])


def response_messages(header: ResponseHeader, parts: list[runtime_pb2.Tensor]) -> Iterator[runtime_pb2.ExpertResponse]:
    yield runtime_pb2.ExpertResponse(metadata=encode_header(header), tensors=parts[:1])
    for part in parts[1:]:
        yield runtime_pb2.ExpertResponse(tensors=[part])


async def read_stream(
    messages: AsyncIterator, header_cls: type[BaseModel], *, max_parts: int = 1 << 16, max_bytes: int | None = None
):
    """Collect a header and its tensor parts from a stream of request or response messages; with
    `max_bytes`, stop reading (RequestTooLargeError) once the parts carry more than that."""
    header, parts, received = None, [], 0
    async for message in messages:
        if max_bytes is not None:
            received += sum(len(part.buffer) for part in message.tensors)
            check_request_bytes(received, max_bytes)
        if header is None:
            if not message.metadata:
                raise ProtocolError("the first message carries no header")
            header = decode_header(header_cls, message.metadata)
        parts.extend(message.tensors)
        if len(parts) > max_parts:
            raise ProtocolError(f"more than {max_parts} tensor parts")
    if header is None:
        raise StreamClosedError("empty stream: closed before any message")
    return header, parts
