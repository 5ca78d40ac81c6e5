"""Tensor codecs for activations and gradients on the wire (issue #5).

A leaf package: it imports torch, numpy, hivemind and bitsandbytes, never the rest of swarm, so
peers can use it without depending on the trainer.

Typical use::

    from swarm.compression import registry
    encoded = registry.encode(activations, "int8")   # header + parts to stream
    restored = registry.decode(encoded)               # on the other side
"""

from swarm.compression.accounting import ByteCounter
from swarm.compression.adaptive import CodecChoice, LinkBandwidthMeter, LinkEstimate, choose_codec
from swarm.compression.base import Codec, CodecError, EncodedTensor, TensorHeader, UnknownCodecError
from swarm.compression.codecs import BlockwiseInt8Codec, Float16Codec, NoneCodec, TopKCodec
from swarm.compression.error_feedback import ErrorFeedback
from swarm.compression.registry import decode, encode, get_codec, known_codecs

__all__ = [
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
    "get_codec",
    "known_codecs",
]
