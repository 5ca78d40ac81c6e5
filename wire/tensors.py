"""Named tensors on the wire: encoding one with a codec, regrouping the parts that follow a header
into one encoded tensor per name, and decoding them.

A sender encodes each tensor (`encode_tensor`); `wire.messages` lists their `TensorHeader`s in the
request or response header and streams their parts. A receiver regroups the parts as the header
lists them (`group_parts`), each checked against its header, then decodes (`decode_tensors`).
Everything that reads a peer's input raises `ProtocolError` and nothing else.

What a receiver will allocate is known from the headers alone (shape and dtype, whatever the codec:
a top-k header of a few bytes may declare a tensor of a gigabyte), so it is checked against the
receiver's limit before any part is read or decoded (`check_decoded_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from hivemind.proto import runtime_pb2

from wire import compression
from wire.compression import CodecError, EncodedTensor, TensorHeader, UnknownCodecError
from wire.protocol import ProtocolError


class DecodedTooLargeError(ProtocolError):
    """The tensors a message declares would decode to more bytes than the receiver accepts."""


def decoded_nbytes(headers: Iterable[TensorHeader]) -> int:
    """Bytes that decoding tensors with these headers allocates (their original shapes and dtypes)."""
    return sum(header.original_nbytes for header in headers)


def check_decoded_bytes(headers: Iterable[TensorHeader], limit: int | None) -> None:
    """Raise `DecodedTooLargeError` when `headers` declare more than `limit` decoded bytes in all
    (None: no limit beyond each tensor's MAX_TENSOR_BYTES)."""
    if limit is None:
        return
    total = decoded_nbytes(headers)
    if total > limit:
        raise DecodedTooLargeError(
            f"the tensors declared decode to {total} bytes, more than the {limit} this receiver accepts"
        )


def check_codec(codec: str, params: Mapping | None = None) -> None:
    """Raise `ProtocolError` unless `codec` with `params` is a codec this side can encode with (a
    codec a peer asked for, checked where its request enters, before any work is done)."""
    try:
        compression.get_codec(codec, **(params or {}))
    except CodecError as e:
        raise ProtocolError(str(e)) from None


def encode_tensor(
    tensor: torch.Tensor,
    codec: str = "none",
    params: dict | None = None,
    *,
    feedback: compression.ErrorFeedback | None = None,
    feedback_key=None,
    max_part_bytes: int | None = None,
) -> EncodedTensor:
    """Encode one tensor (parts of at most `max_part_bytes`, 1 MiB by default). Integer tensors
    (token ids) always travel losslessly. With `feedback`, what the codec drops is kept and added to
    the next tensor under the same key (error feedback, for top-k gradients)."""
    params = dict(params or {})
    if max_part_bytes is not None:
        params["max_part_bytes"] = max_part_bytes
    try:
        codec_impl = compression.get_codec(codec, **params)
        if feedback is not None and tensor.is_floating_point():
            return feedback.compress(feedback_key, tensor.detach(), codec_impl)
        return codec_impl.encode(tensor.detach())
    except CodecError as e:
        raise ProtocolError(str(e)) from None


def group_parts(headers: Mapping[str, TensorHeader], parts: Sequence[runtime_pb2.Tensor]) -> dict[str, EncodedTensor]:
    """The parts that followed a header, regrouped per tensor in the order `headers` lists them and
    checked against each header (count, known codec); nothing is decoded yet."""
    expected = sum(header.num_parts for header in headers.values())
    if len(parts) != expected:
        raise ProtocolError(f"expected {expected} tensor parts in total, got {len(parts)}")
    grouped, offset = {}, 0
    for name, header in headers.items():
        try:
            if header.codec not in compression.known_codecs():
                raise UnknownCodecError(header.codec, compression.known_codecs())
            grouped[name] = EncodedTensor(header, tuple(parts[offset : offset + header.num_parts]))
        except CodecError as e:
            raise ProtocolError(f"tensor {name!r}: {e}") from None
        offset += header.num_parts
    return grouped


def decode_tensors(encoded: Mapping[str, EncodedTensor], *, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Decode every tensor; with `max_bytes`, first check what they would allocate (nothing is
    decoded if that is over)."""
    check_decoded_bytes((item.header for item in encoded.values()), max_bytes)
    decoded = {}
    for name, item in encoded.items():
        try:
            decoded[name] = compression.decode(item)
        except CodecError as e:
            raise ProtocolError(f"tensor {name!r}: {e}") from None
    return decoded
