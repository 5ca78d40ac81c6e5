"""Codecs by name: the one place that maps a header's ``codec`` string to code."""

from __future__ import annotations

import torch

from wire.compression.base import Codec, CodecError, EncodedTensor, UnknownCodecError
from wire.compression.codecs import BlockwiseInt8Codec, Float16Codec, NoneCodec, TopKCodec
from wire.compression.int4 import BlockwiseInt4Codec

# Ordered from least to most compression (the order in which adaptive selection tries them).
_CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (NoneCodec, Float16Codec, BlockwiseInt8Codec, BlockwiseInt4Codec, TopKCodec)
}


def known_codecs() -> list[str]:
    """Registered codec names, least compression first."""
    return list(_CODECS)


def get_codec(name: str, **params) -> Codec:
    """A codec instance, e.g. ``get_codec("topk", fraction=0.05)``. Raises UnknownCodecError for an
    unknown name and CodecError for parameters the codec does not take."""
    if not isinstance(name, str) or name not in _CODECS:
        raise UnknownCodecError(name, known_codecs())
    try:
        return _CODECS[name](**params)
    except TypeError as error:  # unexpected keyword: a caller's mistake, reported as such
        raise CodecError(f"codec {name!r} does not take parameters {sorted(params)}: {error}") from error


def encode(tensor: torch.Tensor, name: str, **params) -> EncodedTensor:
    """Encode ``tensor`` with the codec called ``name``."""
    return get_codec(name, **params).encode(tensor)


def decode(encoded: EncodedTensor) -> torch.Tensor:
    """Decode with the codec the header names; decoding needs nothing but the header and parts."""
    return get_codec(encoded.header.codec).decode(encoded)
