"""The codec contract: what an encoded tensor looks like on the wire and how codecs are called.

An encoded tensor is a small JSON-able :class:`TensorHeader` (codec name, original shape and
dtype, number of parts, per-tensor decode parameters) plus a tuple of hivemind
``runtime_pb2.Tensor`` messages, the *parts*, which the transport streams one by one. Every part
is bounded in size (see ``DEFAULT_MAX_PART_BYTES``) and is itself a valid hivemind tensor
(``NONE`` or ``BLOCKWISE_8BIT`` compression), so ``hivemind.compression.deserialize_torch_tensor``
can read any single part; the header says how the parts map back to the original tensor. It is
the one tensor header on the wire: request and response headers list one per tensor, under its
name (`wire.protocol`).

Headers and parts arrive from untrusted peers: everything that reads them raises
:class:`CodecError` (a ``ValueError``) on malformed input and nothing else.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from hivemind.proto import runtime_pb2

# Largest tensor a header may describe. Bounds what a decoder allocates for a peer's header:
# top-k decoding fills a tensor of this size from a few bytes. 2**28 float32 values = 1 GiB.
MAX_NUMEL = 2**28
# The same bound in bytes, dtype-aware: what decoding one tensor may allocate (2**28 float32 values;
# half as many float64 ones). A receiver caps a whole message lower (`wire.tensors.check_decoded_bytes`).
MAX_TENSOR_BYTES = 2**30
MAX_NDIM = 32
# Parts per tensor: with 1 MiB parts, MAX_NUMEL float32 values need 1024 parts.
MAX_PARTS = 16384
MAX_CODEC_NAME_CHARS = 64
MAX_PARAMS = 16
MAX_PARAM_KEY_CHARS = 64
MAX_PARAM_STR_CHARS = 256
# Parts of 1 MiB stream well over hivemind's P2P (a unary message is capped at about 2 MiB).
DEFAULT_MAX_PART_BYTES = 2**20
# Smallest part size a codec accepts: one 4096-value int8 block with its code fits in 8 KiB.
MIN_PART_BYTES = 8192

# Original dtypes a header may name; the names are str(torch.dtype) without "torch.".
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
FLOATING_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16"})


class CodecError(ValueError):
    """An encoded tensor or header is malformed, or a codec cannot handle a tensor."""


class UnknownCodecError(CodecError):
    """A header or a caller named a codec that is not registered."""

    def __init__(self, name: object, known: list[str]):
        super().__init__(f"unknown codec {name!r}; known codecs: {', '.join(known)}")
        self.name = name
        self.known = known


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``; raises CodecError for dtypes the wire cannot carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise CodecError(f"dtype {name} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def _check_param_value(key: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodecError(f"header param {key!r} is not finite: {value!r}")
        return
    if isinstance(value, str):
        if len(value) > MAX_PARAM_STR_CHARS:
            raise CodecError(f"header param {key!r} is longer than {MAX_PARAM_STR_CHARS} characters")
        return
    raise CodecError(f"header param {key!r} must be a JSON scalar, got {type(value).__name__}")


@dataclass(frozen=True)
class TensorHeader:
    """What a receiver needs, besides the parts, to rebuild a tensor.

    Constructing one validates every field, so a header that exists is well-formed (its
    consistency with the parts is checked by the codec's ``decode``).
    """

    codec: str  # registry name of the codec that produced the parts
    shape: tuple[int, ...]  # shape of the original tensor
    dtype: str  # dtype of the original tensor, e.g. "float32" (a key of SUPPORTED_DTYPES)
    num_parts: int  # how many runtime_pb2.Tensor parts follow the header
    params: dict = field(default_factory=dict)  # per-tensor decode parameters, JSON scalars only

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str) or not 0 < len(self.codec) <= MAX_CODEC_NAME_CHARS:
            raise CodecError(f"header codec must be a non-empty string, got {self.codec!r:.80}")
        if not isinstance(self.shape, (tuple, list)) or len(self.shape) > MAX_NDIM:
            raise CodecError(f"header shape must be a sequence of at most {MAX_NDIM} ints")
        if not all(type(size) is int and size >= 0 for size in self.shape):
            raise CodecError(f"header shape must hold non-negative ints, got {self.shape!r:.200}")
        object.__setattr__(self, "shape", tuple(self.shape))
        if math.prod(self.shape) > MAX_NUMEL:
            raise CodecError(f"header shape {self.shape} has more than MAX_NUMEL={MAX_NUMEL} elements")
        if not isinstance(self.dtype, str) or self.dtype not in SUPPORTED_DTYPES:
            raise CodecError(f"header dtype {self.dtype!r:.80} is not one of {', '.join(SUPPORTED_DTYPES)}")
        if self.original_nbytes > MAX_TENSOR_BYTES:
            raise CodecError(
                f"header shape {self.shape} of {self.dtype} decodes to {self.original_nbytes} bytes, "
                f"more than MAX_TENSOR_BYTES={MAX_TENSOR_BYTES}"
            )
        if type(self.num_parts) is not int or not 0 <= self.num_parts <= MAX_PARTS:
            raise CodecError(f"header num_parts must be an int in [0, {MAX_PARTS}], got {self.num_parts!r:.80}")
        if not isinstance(self.params, dict) or len(self.params) > MAX_PARAMS:
            raise CodecError(f"header params must be a dict of at most {MAX_PARAMS} entries")
        for key, value in self.params.items():
            if not isinstance(key, str) or not 0 < len(key) <= MAX_PARAM_KEY_CHARS:
                raise CodecError(f"header param names must be short strings, got {key!r:.80}")
            _check_param_value(key, value)
        object.__setattr__(self, "params", dict(self.params))  # no aliasing with the caller's dict

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def original_nbytes(self) -> int:
        """Size of the original tensor in memory (what "none" would send)."""
        return self.numel * self.torch_dtype.itemsize

    def to_dict(self) -> dict:
        return {
            "codec": self.codec,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "num_parts": self.num_parts,
            "params": dict(self.params),
        }

    @classmethod
    def from_dict(cls, d: object) -> TensorHeader:
        """Parse a header received from a peer. Unknown top-level keys are ignored so that newer
        peers may add fields; missing or malformed fields raise CodecError."""
        if not isinstance(d, dict):
            raise CodecError(f"header must be a dict, got {type(d).__name__}")
        missing = [key for key in ("codec", "shape", "dtype", "num_parts", "params") if key not in d]
        if missing:
            raise CodecError(f"header lacks {', '.join(missing)}")
        return cls(codec=d["codec"], shape=d["shape"], dtype=d["dtype"], num_parts=d["num_parts"], params=d["params"])


@dataclass(frozen=True)
class EncodedTensor:
    """A header plus the hivemind protobuf parts the transport streams after it."""

    header: TensorHeader
    parts: tuple[runtime_pb2.Tensor, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.header, TensorHeader):
            raise CodecError(f"header must be a TensorHeader, got {type(self.header).__name__}")
        object.__setattr__(self, "parts", tuple(self.parts))
        if not all(isinstance(part, runtime_pb2.Tensor) for part in self.parts):
            raise CodecError("every part must be a hivemind runtime_pb2.Tensor")
        if len(self.parts) != self.header.num_parts:
            raise CodecError(f"header announces {self.header.num_parts} parts, got {len(self.parts)}")

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (sum of the parts' buffers; headers and protobuf framing excluded)."""
        return sum(len(part.buffer) for part in self.parts)


class Codec(abc.ABC):
    """Turns a tensor into an :class:`EncodedTensor` and back.

    ``decode`` depends only on the encoded tensor (header and parts), never on how this instance
    was configured, so any instance of the right class decodes what any peer encoded.
    """

    name: ClassVar[str]

    def __init__(self, *, max_part_bytes: int = DEFAULT_MAX_PART_BYTES):
        """``max_part_bytes`` bounds each part's buffer; it shapes encoding only, never decoding."""
        if type(max_part_bytes) is not int or max_part_bytes < MIN_PART_BYTES:
            raise CodecError(f"max_part_bytes must be an int >= {MIN_PART_BYTES}, got {max_part_bytes!r}")
        self.max_part_bytes = max_part_bytes

    @property
    def params(self) -> dict:
        """Constructor parameters, such that ``type(self)(**self.params)`` encodes the same way."""
        return {}

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        """Encode a CPU tensor (any layout; gradients are detached). Raises CodecError for dtypes
        the codec cannot carry."""

    @abc.abstractmethod
    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        """A new contiguous tensor of ``header.shape`` and ``header.dtype``. Raises CodecError when
        the header names another codec or the parts do not match the header."""

    def _check_header_codec(self, encoded: EncodedTensor) -> None:
        if encoded.header.codec != self.name:
            raise CodecError(f"{self.name!r} codec cannot decode a {encoded.header.codec!r} tensor")

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.params.items())
        return f"{type(self).__name__}({args})"
