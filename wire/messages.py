"""Headers and tensors as hivemind protobuf messages and back: one call per direction on each side.

    the caller (the trainer)                          the peer (a handler)
    write_request(header, tensors)             -->    request = await read_request(messages, RequestHeader,
                                                                                   max_bytes=...)
                                                      checks on request.header; request.decoded(byte_counter)
    answer = await read_response(stream, ...)  <--    write_response(ResponseHeader(...), outputs, byte_counter)
    answer.header.error, else answer.encoded()

Reading stops at the header and the raw parts (`Received`): regrouping the parts per tensor and
decoding them are the receiver's next step, so a handler refuses a request on its header before
paying for either, and a caller reads an answer's error before its tensors. Both steps raise
`ProtocolError` on malformed input; a `ByteCounter` passed to them counts the tensors as they pass.

A chained call may cross on several streams at once (`ChainRequest.pieces`): `request_pieces` and
`response_pieces` cut its messages into that many groups of about equal bytes, one per stream, and
`read_response_pieces` reads the groups that came back as one answer (the receiver's side:
peers/serving/hop_pieces.py).

Unary RPCs (commit, the state request) carry a header alone: `unary_request`, `unary_response`,
`read_unary`. A stage's state streams as its header alone, then the checkpoint bytes in chunks:
`write_state`, `read_state`. `request_messages`/`response_messages` frame a header and raw parts
(the link probe's payload).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ValidationError

from wire.compression import ByteCounter, EncodedTensor
from wire.protocol import (
    MAX_STREAM_PARTS,
    STATE_CHUNK_BYTES,
    ChainPiece,
    ChainRequest,
    CommitRequest,
    Header,
    HopRecordRequest,
    OuterRoundRequest,
    ProbeRequest,
    ProtocolError,
    RequestHeader,
    StateHeader,
    StateRequest,
    StreamClosedError,
    SyncRoundRequest,
    decode_header,
    encode_header,
)
from wire.request_limits import check_request_bytes
from wire.tensors import check_decoded_bytes, decode_tensors, group_parts

Part = TypeVar("Part")

_UIDS = {
    ChainRequest: "train_chain",
    ChainPiece: "chain_piece",
    CommitRequest: "commit",
    StateRequest: "state",
    ProbeRequest: "probe",
    HopRecordRequest: "hop_record",
    OuterRoundRequest: "outer_round",
    SyncRoundRequest: "sync_round",
}


def _uid(header: BaseModel) -> str:
    """A request's `uid`: which call it is, for whoever reads a capture (peers route by RPC name)."""
    return header.rpc if isinstance(header, RequestHeader) else _UIDS.get(type(header), "")


@dataclass(frozen=True)
class Received(Generic[Header]):
    """A request or answer as read off a stream: its validated header and its tensor parts, as they came."""

    header: Header
    parts: tuple[runtime_pb2.Tensor, ...]

    def encoded(self, byte_counter: ByteCounter | None = None) -> dict[str, EncodedTensor]:
        """The parts regrouped per tensor as `header.tensors` lists them, each checked against its
        header; not decoded. With `byte_counter`, each tensor is counted as received."""
        encoded = group_parts(self.header.tensors, self.parts)
        if byte_counter is not None:
            for item in encoded.values():
                byte_counter.record_received(item)
        return encoded

    def decoded(
        self, byte_counter: ByteCounter | None = None, *, max_bytes: int | None = None
    ) -> dict[str, torch.Tensor]:
        """`encoded(byte_counter)`, decoded; with `max_bytes`, refused (DecodedTooLargeError) before
        anything is decoded when the tensors would take more."""
        check_decoded_bytes(self.header.tensors.values(), max_bytes)
        return decode_tensors(self.encoded(byte_counter), max_bytes=max_bytes)


# --- streams ---------------------------------------------------------------------------------------


def with_parts(message_type: type, parts: Sequence[runtime_pb2.Tensor], **fields):
    """A message of `message_type` carrying `parts`, each copied in with `CopyFrom`. (Passing them as
    `tensors=[...]`, or appending them, copies each part into freshly mapped memory: about 1 ms of CPU
    per MiB in page faults, against 0.04 ms; benchmarks/RESULTS.md, "Transport cost (issue #55)".)"""
    message = message_type(**fields)
    for part in parts:
        message.tensors.add().CopyFrom(part)
    return message


PACKED_BYTES = 1 << 20  # parts ride together in one message up to this many bytes (a larger part alone)


def packed(parts: Sequence[Part]) -> list[list[Part]]:
    """`parts` in order, in groups of at most PACKED_BYTES each (a part that large alone), at least
    one group (maybe empty): a small request or answer is one message, header and tensors, instead
    of one message per part."""
    groups: list[list[Part]] = [[]]
    size = 0
    for part in parts:
        nbytes = len(part.buffer)
        if groups[-1] and size + nbytes > PACKED_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(part)
        size += nbytes
    return groups


def request_messages(header: BaseModel, parts: Sequence[runtime_pb2.Tensor]) -> Iterator[runtime_pb2.ExpertRequest]:
    """The header with the first group of parts (`packed`), then a message per group."""
    first, *others = packed(parts)
    yield with_parts(runtime_pb2.ExpertRequest, first, uid=_uid(header), metadata=encode_header(header))
    for group in others:
        yield with_parts(runtime_pb2.ExpertRequest, group)


def response_messages(header: BaseModel, parts: Sequence[runtime_pb2.Tensor]) -> Iterator[runtime_pb2.ExpertResponse]:
    """The header with the first group of parts (`packed`), then a message per group."""
    first, *others = packed(parts)
    yield with_parts(runtime_pb2.ExpertResponse, first, metadata=encode_header(header))
    for group in others:
        yield with_parts(runtime_pb2.ExpertResponse, group)


def split_parts(parts: Sequence[Part], count: int) -> list[list[Part]]:
    """`parts` (each with a `buffer`) in `count` contiguous groups of about equal bytes, in order;
    a group may be empty. Each part goes to the group its middle byte falls in."""
    sizes = [len(part.buffer) for part in parts]
    total = sum(sizes) or 1
    groups: list[list[Part]] = [[] for _ in range(count)]
    offset = 0
    for part, size in zip(parts, sizes, strict=True):
        groups[min(count - 1, (2 * offset + size) * count // (2 * total))].append(part)
        offset += size
    return groups


def request_pieces(
    header: ChainRequest,
    tensors: Iterable[tuple[str, EncodedTensor]],
    piece_header: Callable[[int], ChainPiece],
) -> list[list[runtime_pb2.ExpertRequest]]:
    """A chained call's messages on `header.pieces` streams: `header` (its `tensors` field filled
    in) with the first group of parts, then piece `i`'s header (`piece_header(i)`) with group `i`."""
    header, parts = _with_tensors(header, tensors)
    groups = split_parts(parts, header.pieces)
    return [list(request_messages(piece_header(i) if i else header, group)) for i, group in enumerate(groups)]


def response_pieces(
    header: BaseModel,
    tensors: Iterable[tuple[str, EncodedTensor]],
    count: int,
    byte_counter: ByteCounter | None = None,
) -> list[list[runtime_pb2.ExpertResponse]]:
    """An answer's messages on `count` streams: `header` with the first group of parts on the
    call's own stream, each other group as parts alone (one per message) on its piece's stream.
    With `byte_counter`, each tensor is counted as sent."""
    tensors = list(tensors)
    header, parts = _with_tensors(header, tensors)
    if byte_counter is not None:
        for _, encoded in tensors:
            byte_counter.record_sent(encoded)
    first, *others = split_parts(parts, count)
    return [
        list(response_messages(header, first)),
        *(
            [with_parts(runtime_pb2.ExpertResponse, part_group) for part_group in packed(group)] if group else []
            for group in others
        ),
    ]


def _with_tensors(header: Header, tensors: Iterable[tuple[str, EncodedTensor]]) -> tuple[Header, list]:
    """The header with its `tensors` field listing `tensors`, and their parts in that order."""
    named = list(tensors)
    if not named:
        return header, []
    headers = {}
    for name, encoded in named:
        if name in headers:
            raise ProtocolError(f"tensor {name!r} is sent twice")
        headers[name] = encoded.header
    try:
        header = type(header).model_validate({**dict(header), "tensors": headers})
    except ValidationError as e:
        raise ProtocolError(f"cannot send these tensors: {e}") from None
    return header, [part for _, encoded in named for part in encoded.parts]


def write_request(
    header: RequestHeader, tensors: Iterable[tuple[str, EncodedTensor]] = ()
) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    """The messages of a streamed request (what `P2P.iterate_protobuf_handler` sends): `header`,
    its `tensors` field filled in from `tensors` (name, encoded), then their parts."""
    header, parts = _with_tensors(header, tensors)
    return _as_async(request_messages(header, parts))


def write_response(
    header: BaseModel, tensors: Iterable[tuple[str, EncodedTensor]] = (), byte_counter: ByteCounter | None = None
) -> Iterator[runtime_pb2.ExpertResponse]:
    """The messages of a streamed answer (what a handler yields): `header`, its `tensors` field
    filled in from `tensors` (name, encoded), then their parts. With `byte_counter`, each tensor is
    counted as sent (now, not as the messages go)."""
    return iter(response_pieces(header, tensors, 1, byte_counter)[0])


async def _read(
    messages: AsyncIterator,
    header_cls: type[Header],
    max_parts: int,
    max_bytes: int | None,
    max_decoded_bytes: int | None = None,
):
    header, parts, received = None, [], 0
    async for message in messages:
        if max_bytes is not None:
            received += sum(len(part.buffer) for part in message.tensors)
            check_request_bytes(received, max_bytes)
        if header is None:
            if not message.metadata:
                raise ProtocolError("the first message carries no header")
            header = decode_header(header_cls, message.metadata)
            # what the tensors would take once decoded, known from the header: refused before reading on
            check_decoded_bytes(getattr(header, "tensors", {}).values(), max_decoded_bytes)
        parts.extend(message.tensors)
        if len(parts) > max_parts:
            raise ProtocolError(f"more than {max_parts} tensor parts")
    if header is None:
        raise StreamClosedError("empty stream: closed before any message")
    return Received(header, tuple(parts))


async def read_request(
    messages: AsyncIterator[runtime_pb2.ExpertRequest],
    header_cls: type[Header],
    *,
    max_bytes: int | None = None,
    max_parts: int = MAX_STREAM_PARTS,
    max_decoded_bytes: int | None = None,
) -> Received[Header]:
    """Read a whole streamed request: its header (validated) and its parts. With `max_bytes`, stop
    reading (RequestTooLargeError) once the parts carry more than that; with `max_decoded_bytes`,
    stop at the header (DecodedTooLargeError, a ProtocolError) when its tensors would decode to more.
    Raises ProtocolError on a malformed stream, StreamClosedError (a ProtocolError) on an empty one."""
    return await _read(messages, header_cls, max_parts, max_bytes, max_decoded_bytes)


async def read_response(
    messages: AsyncIterator[runtime_pb2.ExpertResponse],
    header_cls: type[Header],
    *,
    max_parts: int = MAX_STREAM_PARTS,
    max_decoded_bytes: int | None = None,
) -> Received[Header]:
    """Read a whole streamed answer: its header (validated) and its parts; errors and
    `max_decoded_bytes` as `read_request`."""
    return await _read(messages, header_cls, max_parts, None, max_decoded_bytes)


async def read_response_pieces(
    answers: Sequence[Sequence[runtime_pb2.ExpertResponse]],
    header_cls: type[Header],
    *,
    max_decoded_bytes: int | None = None,
) -> Received[Header]:
    """An answer that came back on several streams (`response_pieces`' groups, in order), read as
    `read_response` reads one stream. A piece stream answers parts alone: one that answered a
    header is a ProtocolError."""
    for index, messages in enumerate(answers[1:], 1):
        if any(message.metadata for message in messages):
            raise ProtocolError(f"piece {index} of the call answered a header, not parts alone")
    messages = _as_async(message for group in answers for message in group)
    return await _read(messages, header_cls, MAX_STREAM_PARTS, None, max_decoded_bytes)


async def _as_async(messages: Iterable):
    for message in messages:
        yield message


# --- unary calls and the state stream --------------------------------------------------------------


def unary_request(header: BaseModel) -> runtime_pb2.ExpertRequest:
    """A unary call's request: the header alone."""
    return runtime_pb2.ExpertRequest(uid=_uid(header), metadata=encode_header(header))


def unary_response(header: BaseModel) -> runtime_pb2.ExpertResponse:
    """A unary call's answer: the header alone."""
    return runtime_pb2.ExpertResponse(metadata=encode_header(header))


def read_unary(message: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse, header_cls: type[Header]) -> Header:
    """The header of a unary call's request or answer; ProtocolError if malformed."""
    return decode_header(header_cls, message.metadata)


def write_state(header: StateHeader, data: bytes) -> Iterator[runtime_pb2.ExpertResponse]:
    """A stage's state: the header alone, then `header.total_bytes` of data in chunks of 1 MiB."""
    yield runtime_pb2.ExpertResponse(metadata=encode_header(header))
    for offset in range(0, len(data), STATE_CHUNK_BYTES):
        yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=data[offset : offset + STATE_CHUNK_BYTES])])


async def read_state(
    messages: AsyncIterator[runtime_pb2.ExpertResponse], *, sender: str, max_bytes: int | None = None
) -> bytes:
    """The state bytes a `write_state` stream carries. Raises ProtocolError when `sender` (named in
    the message) refused, announced more than `max_bytes` or sent more than it announced;
    StreamClosedError (a ProtocolError) when the stream ended before all the state came."""
    return (await read_state_and_header(messages, sender=sender, max_bytes=max_bytes))[1]


async def read_state_and_header(
    messages: AsyncIterator[runtime_pb2.ExpertResponse], *, sender: str, max_bytes: int | None = None
) -> tuple[StateHeader, bytes]:
    """`read_state`, with the header the state came under (its steps and digest)."""
    header, chunks, received = None, [], 0
    async for response in messages:
        if header is None:
            header = decode_header(StateHeader, response.metadata)
            if header.error:
                raise ProtocolError(f"replica {sender} refused: {header.error}")
            if max_bytes is not None and header.total_bytes > max_bytes:
                raise ProtocolError(
                    f"replica {sender} announced {header.total_bytes} bytes of state, more than such a stage "
                    f"can take ({max_bytes})"
                )
            continue
        for part in response.tensors:
            received += len(part.buffer)
            if received > header.total_bytes:
                raise ProtocolError("the replica sent more state than it announced")
            chunks.append(part.buffer)
    if header is None or received != header.total_bytes:  # the connection closed under it: worth a retry
        raise StreamClosedError(f"state transfer from {sender} ended early ({received} bytes)")
    return header, b"".join(chunks)
