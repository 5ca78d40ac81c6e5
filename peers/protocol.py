"""The peer's wire contract, in one place: RPC names, typed request/response headers, and how
tensors are packed into a stream of hivemind protobuf messages.

A call is a stream of `ExpertRequest` messages: the first carries the msgpack-encoded
`RequestHeader` in `metadata`; tensor parts (each at most `PART_BYTES`) follow, in the order the
header lists the tensors. The answer is a stream of `ExpertResponse` messages built the same way
around a `ResponseHeader`. A peer answers a request it refuses with `ResponseHeader.error` set,
never by dropping the stream, so the trainer can tell a bad request from a dead peer.
"""

from __future__ import annotations

from enum import Enum
from typing import AsyncIterator, Iterable, Iterator, Literal

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from pydantic import BaseModel, ConfigDict, Field, ValidationError

RPC_FORWARD = "swarm.forward"
RPC_BACKWARD = "swarm.backward"
PART_BYTES = 1 << 20  # unary p2p messages are capped near 2 MiB: stream tensors in 1 MiB parts
MAX_HEADER_BYTES = 64 << 10
MAX_TENSORS = 4
MAX_TENSOR_ELEMENTS = 1 << 28

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                  "bfloat16": torch.bfloat16, "int64": torch.int64}


class ProtocolError(ValueError):
    """A message that does not follow the wire contract."""


class ErrorKind(str, Enum):
    BAD_REQUEST = "bad_request"  # the caller's fault: wrong shape/dtype/stage/codec; do not retry as is
    WRONG_STAGE = "wrong_stage"  # the peer serves another stage now (it moved); refresh the route
    INTERNAL = "internal"  # the peer failed; retry elsewhere


class TensorMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(max_length=32)
    codec: str = Field(max_length=32)
    shape: tuple[int, ...] = Field(max_length=8)
    dtype: str = Field(max_length=16)
    num_parts: int = Field(ge=1, le=1 << 16)

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
    response_codec: str = Field(default="none", max_length=32)


class ResponseHeader(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    tensors: tuple[TensorMeta, ...] = Field(default=(), max_length=MAX_TENSORS)
    loss: float | None = None
    compute_s: float = 0.0
    queue_s: float = 0.0
    error: str | None = Field(default=None, max_length=4096)
    error_kind: ErrorKind | None = None


def encode_header(header: BaseModel) -> bytes:
    return msgpack.packb(header.model_dump(mode="json"), use_bin_type=True)


def decode_header(cls: type[BaseModel], data: bytes) -> BaseModel:
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
        if isinstance(raw, dict) and "tensors" in raw and isinstance(raw["tensors"], list):
            raw["tensors"] = tuple({**t, "shape": tuple(t["shape"])} if isinstance(t, dict) and isinstance(t.get("shape"), list) else t
                                   for t in raw["tensors"])
        if isinstance(raw, dict) and raw.get("error_kind") is not None:
            raw["error_kind"] = ErrorKind(raw["error_kind"])
        return cls.model_validate(raw)
    except (ValidationError, ValueError, TypeError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed {cls.__name__}: {e}") from None


# --- tensors <-> parts ---------------------------------------------------------------------------

def pack_tensor(name: str, tensor: torch.Tensor, codec: str = "none") -> tuple[TensorMeta, list[runtime_pb2.Tensor]]:
    """Serialize one tensor into protobuf parts of at most PART_BYTES each."""
    if codec != "none":
        raise ProtocolError(f"unknown codec {codec!r}")
    tensor = tensor.detach()
    serialized = serialize_torch_tensor(tensor.contiguous(), runtime_pb2.CompressionType.NONE)
    parts = list(split_for_streaming(serialized, PART_BYTES))
    meta = TensorMeta(name=name, codec=codec, shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                      num_parts=len(parts))
    return meta, parts


def unpack_tensor(meta: TensorMeta, parts: list[runtime_pb2.Tensor]) -> torch.Tensor:
    """Rebuild a tensor and check it matches what its meta promised."""
    if meta.codec != "none":
        raise ProtocolError(f"unknown codec {meta.codec!r} (this peer knows: none)")
    if meta.dtype not in DTYPES:
        raise ProtocolError(f"tensor {meta.name!r}: unsupported dtype {meta.dtype!r}")
    if meta.numel() > MAX_TENSOR_ELEMENTS:
        raise ProtocolError(f"tensor {meta.name!r} of shape {meta.shape} is larger than allowed")
    if len(parts) != meta.num_parts:
        raise ProtocolError(f"tensor {meta.name!r}: expected {meta.num_parts} parts, got {len(parts)}")
    try:
        tensor = deserialize_torch_tensor(combine_from_streaming(parts))
    except Exception as e:  # a malformed buffer can fail in numpy/torch in many ways
        raise ProtocolError(f"tensor {meta.name!r} could not be decoded: {e}") from None
    if tuple(tensor.shape) != meta.shape or tensor.dtype != DTYPES[meta.dtype]:
        raise ProtocolError(f"tensor {meta.name!r}: header says {meta.shape} {meta.dtype}, "
                            f"payload is {tuple(tensor.shape)} {tensor.dtype}")
    return tensor


def pack_named(tensors: Iterable[tuple[str, torch.Tensor]], codec: str = "none") -> tuple[tuple[TensorMeta, ...], list[runtime_pb2.Tensor]]:
    metas, parts = [], []
    for name, tensor in tensors:
        meta, tensor_parts = pack_tensor(name, tensor, codec)
        metas.append(meta)
        parts.extend(tensor_parts)
    return tuple(metas), parts


def unpack_named(metas: tuple[TensorMeta, ...], parts: list[runtime_pb2.Tensor]) -> dict[str, torch.Tensor]:
    expected = sum(m.num_parts for m in metas)
    if len(parts) != expected:
        raise ProtocolError(f"expected {expected} tensor parts in total, got {len(parts)}")
    result, offset = {}, 0
    for meta in metas:
        if meta.name in result:
            raise ProtocolError(f"tensor {meta.name!r} is sent twice")
        result[meta.name] = unpack_tensor(meta, parts[offset: offset + meta.num_parts])
        offset += meta.num_parts
    return result


# --- messages ------------------------------------------------------------------------------------

def request_messages(header: RequestHeader, parts: list[runtime_pb2.Tensor]) -> Iterator[runtime_pb2.ExpertRequest]:
    yield runtime_pb2.ExpertRequest(uid=header.rpc, metadata=encode_header(header), tensors=parts[:1])
    for part in parts[1:]:
        yield runtime_pb2.ExpertRequest(tensors=[part])


def response_messages(header: ResponseHeader, parts: list[runtime_pb2.Tensor]) -> Iterator[runtime_pb2.ExpertResponse]:
    yield runtime_pb2.ExpertResponse(metadata=encode_header(header), tensors=parts[:1])
    for part in parts[1:]:
        yield runtime_pb2.ExpertResponse(tensors=[part])


async def read_stream(messages: AsyncIterator, header_cls: type[BaseModel], *, max_parts: int = 1 << 16):
    """Collect a header and its tensor parts from a stream of request or response messages."""
    header, parts = None, []
    async for message in messages:
        if header is None:
            if not message.metadata:
                raise ProtocolError("the first message carries no header")
            header = decode_header(header_cls, message.metadata)
        parts.extend(message.tensors)
        if len(parts) > max_parts:
            raise ProtocolError(f"more than {max_parts} tensor parts")
    if header is None:
        raise ProtocolError("empty stream")
    return header, parts
