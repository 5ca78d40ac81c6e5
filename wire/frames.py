"""The data plane's framing (wire/data_plane.py): hivemind's stream messages as frames on a TLS
connection, with the tensor bytes raw after a typed header instead of inside a protobuf.

A frame is a 9-byte prefix (`kind`: one byte; the header's length and the payload's length: 4
bytes each, big-endian), a msgpack `FrameHeader`, then `payload` bytes:

    HELLO    header.token            a caller's first frame: the token the peer issued it over p2pd
    WELCOME  -                       the peer took the token; calls may follow
    REFUSED  header.error            the peer did not; it closes the connection
    CALL     header.rpc              a call begins: the RPC it calls (one call at a time)
    MESSAGE  header.metadata, parts  one ExpertRequest or ExpertResponse: its metadata (the typed
                                     header of wire/protocol.py) and its tensor parts, whose bytes
                                     are the payload, back to back
    END                              the end of a call's request, or of its answer
    ERROR    header.error            the handler failed (hivemind's error message); the answer ends

A receiver refuses a frame from its prefix, before reading the rest, when the header would exceed
MAX_FRAME_HEADER_BYTES or the payload the receiver's `max_message_bytes` (MessageTooLargeError),
and validates the header (`FrameHeader`: at most MAX_FRAME_PARTS parts, each part's dtype, shape
and length within the codec limits, lengths summing to the payload's) before any payload byte is
used. Every malformed frame raises `ProtocolError` and nothing else. Pure: no I/O.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from wire.bounded_streams import MessageTooLargeError
from wire.compression.base import MAX_NDIM
from wire.protocol import MAX_HEADER_BYTES, ProtocolError

HELLO, WELCOME, REFUSED, CALL, MESSAGE, END, ERROR = range(1, 8)
KINDS = frozenset((HELLO, WELCOME, REFUSED, CALL, MESSAGE, END, ERROR))
PREFIX = struct.Struct(">BII")
MAX_FRAME_HEADER_BYTES = MAX_HEADER_BYTES + (16 << 10)  # the metadata, and the parts' descriptions
MAX_FRAME_PARTS = 16  # tensor parts in one message (wire/messages.py sends one)
MAX_RPC_NAME_CHARS = 64
MAX_TOKEN_CHARS = 128
MAX_ERROR_CHARS = 4096


class PartHeader(BaseModel):
    """One tensor part: the fields of hivemind's `runtime_pb2.Tensor` the codecs use, and its length."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    compression: int = Field(ge=0, le=255)
    dtype: str = Field(max_length=16)
    size: list[Annotated[int, Field(ge=0, le=1 << 40)]] = Field(max_length=MAX_NDIM)
    nbytes: int = Field(ge=0)


class FrameHeader(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    rpc: str | None = Field(default=None, min_length=1, max_length=MAX_RPC_NAME_CHARS)
    metadata: bytes = Field(default=b"", max_length=MAX_HEADER_BYTES)
    parts: list[PartHeader] = Field(default_factory=list, max_length=MAX_FRAME_PARTS)
    token: str | None = Field(default=None, min_length=16, max_length=MAX_TOKEN_CHARS)
    error: str | None = Field(default=None, max_length=MAX_ERROR_CHARS)

    @model_validator(mode="after")
    def _lengths_fit(self) -> FrameHeader:
        if sum(part.nbytes for part in self.parts) > 1 << 32:
            raise ValueError("the parts are longer than a frame's payload can be")
        return self


_EMPTY = FrameHeader()


# --- sending -----------------------------------------------------------------------------------------


def frame(kind: int, fields: dict | None = None, payload_bytes: int = 0) -> bytes:
    """A frame's prefix and header, `fields` being a `FrameHeader`'s (the payload, if any, follows
    as the caller's own buffers)."""
    data = msgpack.packb(fields, use_bin_type=True) if fields else b""
    return PREFIX.pack(kind, len(data), payload_bytes) + data


def message_frame(message: Any) -> list:
    """An ExpertRequest or ExpertResponse as a MESSAGE frame: the prefix and header, then each
    part's bytes as they are (nothing is copied into a new buffer here)."""
    buffers = [part.buffer for part in message.tensors]
    fields: dict[str, Any] = {"metadata": message.metadata} if message.metadata else {}
    if buffers:
        fields["parts"] = [
            {"compression": part.compression, "dtype": part.dtype, "size": list(part.size), "nbytes": len(buffer)}
            for part, buffer in zip(message.tensors, buffers, strict=True)
        ]
    return [frame(MESSAGE, fields, sum(len(buffer) for buffer in buffers)), *buffers]


def call_frame(rpc: str) -> bytes:
    return frame(CALL, {"rpc": rpc})


END_FRAME = PREFIX.pack(END, 0, 0)


def hello_frame(token: str) -> bytes:
    return frame(HELLO, {"token": token})


def error_frame(kind: int, error: str) -> bytes:
    """An ERROR or REFUSED frame."""
    return frame(kind, {"error": error[:MAX_ERROR_CHARS]})


# --- receiving ---------------------------------------------------------------------------------------


def parse_prefix(data: bytes | bytearray | memoryview, max_payload_bytes: int) -> tuple[int, int, int]:
    """(kind, header length, payload length) of a frame's 9-byte prefix, refused before the rest is read."""
    kind, header_len, payload_len = PREFIX.unpack(data)
    if kind not in KINDS:
        raise ProtocolError(f"invalid frame kind {kind}")
    if header_len > MAX_FRAME_HEADER_BYTES:
        raise MessageTooLargeError(f"a frame header of {header_len} bytes exceeds {MAX_FRAME_HEADER_BYTES}")
    if payload_len > max_payload_bytes:
        raise MessageTooLargeError(
            f"a frame of {payload_len} bytes exceeds the {max_payload_bytes} this side reads in one message"
        )
    if payload_len and kind != MESSAGE:
        raise ProtocolError(f"a frame of kind {kind} carries no payload")
    return kind, header_len, payload_len


def parse_header(data: bytes | bytearray | memoryview, payload_len: int) -> FrameHeader:
    """A frame's header, validated, with its parts' lengths summing to `payload_len`."""
    if not data:
        header = _EMPTY
    else:
        try:
            fields = msgpack.unpackb(
                data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES, max_str_len=MAX_ERROR_CHARS
            )
            header = FrameHeader.model_validate(fields)
        except (ValidationError, ValueError, TypeError, msgpack.UnpackException) as e:
            raise ProtocolError(f"malformed frame header: {e}") from None
    if sum(part.nbytes for part in header.parts) != payload_len:
        raise ProtocolError(f"the parts' lengths do not add up to the frame's {payload_len} bytes")
    return header


def to_message(header: FrameHeader, payload: bytes | bytearray | memoryview, message_type: type) -> Any:
    """The ExpertRequest or ExpertResponse a MESSAGE frame carries."""
    message, view, offset = message_type(metadata=header.metadata), memoryview(payload), 0
    try:
        for part in header.parts:  # built in place (a part passed in is copied into fresh pages: wire.messages)
            message.tensors.add(
                buffer=bytes(view[offset : offset + part.nbytes]),
                size=part.size,
                dtype=part.dtype,
                compression=part.compression,
            )
            offset += part.nbytes
    except ValueError as e:  # an enum value protobuf does not know
        raise ProtocolError(f"malformed frame: {e}") from None
    return message
