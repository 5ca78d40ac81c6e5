"""Flat tensors <-> bounded-size hivemind ``runtime_pb2.Tensor`` parts, read back strictly.

Two part formats, both readable by ``hivemind.compression.deserialize_torch_tensor``:

- raw: ``compression=NONE``, 1-D, the values' bytes as they are in memory (bfloat16 as its 16
  bits, not hivemind's legacy float32 widening);
- blockwise int8: ``compression=BLOCKWISE_8BIT``, 1-D float32, hivemind's layout
  ``[int64 n_absmax][int64 n_code][float32 absmax...][float32 code...][uint8 values...]`` with
  bitsandbytes blocks of 4096 values.

A flat tensor becomes one or more parts of at most ``max_part_bytes`` each (at least one part,
empty for an empty tensor). :class:`PartReader` walks the parts of an encoded tensor in order and
checks every field and length before touching a buffer, so a malformed part raises CodecError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from wire.compression.base import SUPPORTED_DTYPES, CodecError, dtype_name

INT8_BLOCK_SIZE = 4096  # hivemind's _BLOCKWISE_QUANTIZATION_BLOCKSIZE
INT8_CODE_SIZE = 256  # entries in bitsandbytes' dynamic 8-bit code
_INT8_FIXED_BYTES = 16 + 4 * INT8_CODE_SIZE  # two int64 counts + the code


def _numpy_view(flat: torch.Tensor) -> np.ndarray:
    """A numpy view sharing memory with a contiguous CPU tensor (bfloat16 seen as int16)."""
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy()
    return flat.numpy()


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(np.int16) if name == "bfloat16" else np.dtype(name)


def _chunks(flat: torch.Tensor, elements_per_part: int) -> list[torch.Tensor]:
    if flat.numel() == 0:
        return [flat]
    return list(flat.split(elements_per_part))


def raw_parts(flat: torch.Tensor, max_part_bytes: int) -> list[runtime_pb2.Tensor]:
    """Split a 1-D contiguous CPU tensor into raw parts of at most ``max_part_bytes`` each."""
    name = dtype_name(flat.dtype)
    elements_per_part = max(1, max_part_bytes // flat.element_size())
    return [
        runtime_pb2.Tensor(
            compression=runtime_pb2.NONE,
            buffer=_numpy_view(chunk).tobytes(),
            size=[chunk.numel()],
            dtype=name,
        )
        for chunk in _chunks(flat, elements_per_part)
    ]


def int8_elements_per_part(max_part_bytes: int) -> int:
    """Whole 4096-value blocks that fit in ``max_part_bytes`` with their absmax and the code."""
    blocks = (max_part_bytes - _INT8_FIXED_BYTES) // (INT8_BLOCK_SIZE + 4)
    return max(1, blocks) * INT8_BLOCK_SIZE


def int8_nbytes(numel: int) -> int:
    """Exact buffer bytes of one blockwise int8 part holding ``numel`` values."""
    return _INT8_FIXED_BYTES + 4 * math.ceil(numel / INT8_BLOCK_SIZE) + numel


def int8_parts(flat: torch.Tensor, max_part_bytes: int) -> list[runtime_pb2.Tensor]:
    """Quantize a 1-D contiguous float32 CPU tensor with hivemind's BLOCKWISE_8BIT, part by part.
    Parts hold whole blocks, so the result is the same as quantizing the tensor in one go."""
    if flat.dtype != torch.float32:
        raise CodecError(f"blockwise int8 parts take float32 values, got {flat.dtype}")
    return [
        serialize_torch_tensor(chunk, runtime_pb2.BLOCKWISE_8BIT)
        for chunk in _chunks(flat, int8_elements_per_part(max_part_bytes))
    ]


class PartReader:
    """Reads the parts of one encoded tensor front to back, validating each before decoding it."""

    def __init__(self, parts: Sequence[runtime_pb2.Tensor]):
        self._parts = parts
        self._next = 0

    def _take(self, compression: int, dtype: str) -> tuple[runtime_pb2.Tensor, int]:
        if self._next >= len(self._parts):
            raise CodecError(f"expected more than {len(self._parts)} parts")
        index = self._next
        part = self._parts[index]
        self._next += 1
        if part.compression != compression or part.dtype != dtype:
            raise CodecError(
                f"part {index}: expected compression {compression} and dtype {dtype}, "
                f"got {part.compression} and {part.dtype!r:.40}"
            )
        if part.requires_grad:
            raise CodecError(f"part {index}: requires_grad must be unset")
        if len(part.size) != 1:
            raise CodecError(f"part {index}: expected a 1-D part, got size {list(part.size)[:8]}")
        return part, part.size[0]

    def _pieces(self, numel: int, dtype: str, compression: int) -> list[tuple[runtime_pb2.Tensor, int, int]]:
        """The parts that hold the next ``numel`` values, as (part, start, count) triples."""
        pieces, filled = [], 0
        while True:
            part, count = self._take(compression, dtype)
            if count == 0 and numel > 0:
                raise CodecError(f"part {self._next - 1}: empty part inside a non-empty tensor")
            if filled + count > numel:
                raise CodecError(f"parts hold more than the {numel} values the header announces")
            pieces.append((part, filled, count))
            filled += count
            if filled == numel:
                return pieces

    def read_raw(self, numel: int, dtype: str) -> torch.Tensor:
        """The next ``numel`` values of ``dtype`` from raw parts, as a new 1-D tensor."""
        pieces = self._pieces(numel, dtype, runtime_pb2.NONE)
        item = _numpy_dtype(dtype)
        for part, _, count in pieces:  # check every length before allocating anything
            if len(part.buffer) != count * item.itemsize:
                raise CodecError(
                    f"raw part holds {len(part.buffer)} bytes, {count} {dtype} values need {count * item.itemsize}"
                )
        out = torch.empty(numel, dtype=SUPPORTED_DTYPES[dtype])
        target = _numpy_view(out)
        for part, start, count in pieces:
            values = np.frombuffer(part.buffer, dtype=item)
            if dtype == "bool" and count and values.view(np.uint8).max() > 1:
                raise CodecError("bool part holds bytes other than 0 and 1")
            target[start : start + count] = values
        return out

    def read_int8(self, numel: int) -> torch.Tensor:
        """The next ``numel`` values from blockwise int8 parts, dequantized to a new float32 tensor."""
        pieces = self._pieces(numel, "float32", runtime_pb2.BLOCKWISE_8BIT)
        for part, _, count in pieces:  # check every layout before allocating or dequantizing
            if len(part.buffer) != int8_nbytes(count):
                raise CodecError(f"int8 part holds {len(part.buffer)} bytes, {count} values need {int8_nbytes(count)}")
            num_absmax, code_size = np.frombuffer(part.buffer, dtype=np.int64, count=2).tolist()
            if num_absmax != math.ceil(count / INT8_BLOCK_SIZE) or code_size != INT8_CODE_SIZE:
                raise CodecError(
                    f"int8 part announces {num_absmax} scales and a {code_size}-entry code for {count} values"
                )
        out = torch.empty(numel, dtype=torch.float32)
        for part, start, count in pieces:
            out[start : start + count] = deserialize_torch_tensor(part)
        return out

    def finish(self) -> None:
        """Raise CodecError if parts remain unread."""
        if self._next != len(self._parts):
            raise CodecError(f"{len(self._parts) - self._next} unexpected trailing parts")
