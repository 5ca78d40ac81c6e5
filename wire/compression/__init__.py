"""Tensor codecs for activations and gradients on the wire (issue #5).

A leaf package: it imports torch, numpy, hivemind and bitsandbytes, never the rest of swarm, so
peers can use it without depending on the trainer.

Typical use::

    from wire.compression import registry
    encoded = registry.encode(activations, "int8")   # header + parts to stream
    restored = registry.decode(encoded)               # on the other side
"""

from wire.compression.accounting import ByteCounter
from wire.compression.adaptive import CodecChoice, LinkBandwidthMeter, LinkEstimate, choose_codec, estimated_nbytes
from wire.compression.base import MIN_PART_BYTES, Codec, CodecError, EncodedTensor, TensorHeader, UnknownCodecError
from wire.compression.codecs import (
    RELATIVE_ERROR_BOUNDS,
    BlockwiseInt8Codec,
    Float16Codec,
    NoneCodec,
    TopKCodec,
    relative_error_bound,
)
from wire.compression.error_feedback import ErrorFeedback
from wire.compression.int4 import BlockwiseInt4Codec
from wire.compression.registry import decode, encode, get_codec, known_codecs

__all__ = [
    "MIN_PART_BYTES",
    "RELATIVE_ERROR_BOUNDS",
    "BlockwiseInt4Codec",
    "BlockwiseInt8Codec",
    "ByteCounter",
    "Codec",
    "CodecChoice",
    "CodecError",
    "EncodedTensor",
    "ErrorFeedback",
    "Float16Codec",
    "LinkBandwidthMeter",
    "LinkEstimate",
    "NoneCodec",
    "TensorHeader",
    "TopKCodec",
    "UnknownCodecError",
    "choose_codec",
    "decode",
    "encode",
    "estimated_nbytes",
    "get_codec",
    "known_codecs",
    "relative_error_bound",
]
