"""The trainer's codec policy: `wire.compression.policy` (there since peers choose their hops'
codecs with it too, under direct routing)."""

from wire.compression.policy import CODEC_MODES, CodecPolicy

__all__ = ["CODEC_MODES", "CodecPolicy"]
