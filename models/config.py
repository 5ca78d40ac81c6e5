"""Model configurations: one frozen dataclass, and the named configs the CLI accepts."""

from __future__ import annotations

from dataclasses import dataclass, asdict


class UnknownModelError(ValueError):
    """Raised for a model name that is not in `MODEL_CONFIGS`."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A decoder-only transformer (nanoGPT-like).

    vocab_size: tokens in the vocabulary (256 for byte-level text).
    seq_len: context length in tokens; every microbatch is (batch, seq_len).
    n_layers: transformer blocks, split across pipeline stages.
    d_model: width of the residual stream.
    n_heads: attention heads; d_model must be divisible by it.
    mlp_ratio: hidden width of the MLP as a multiple of d_model.
    dropout: kept at 0 so a pipeline and one process compute the same thing.
    """

    name: str
    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 6
    d_model: int = 256
    n_heads: int = 8
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if min(self.vocab_size, self.seq_len, self.n_layers, self.d_model, self.n_heads) <= 0:
            raise ValueError(f"model config {self.name!r} has a non-positive size")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_parameters(self) -> int:
        """Parameter count of the whole model (embeddings, blocks, final norm and head)."""
        d, v, t = self.d_model, self.vocab_size, self.seq_len
        block = 4 * d * d + 4 * d + 2 * self.mlp_ratio * d * d + self.mlp_ratio * d + d + 4 * d
        return v * d + t * d + self.n_layers * block + 2 * d + d * v + v

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_CONFIGS: dict[str, GPTConfig] = {
    # For tests: trains in seconds on one core.
    "tiny": GPTConfig(name="tiny", seq_len=32, n_layers=3, d_model=32, n_heads=4),
    # For the demo and loopback benchmarks: ~4.9M parameters.
    "small": GPTConfig(name="small", seq_len=128, n_layers=6, d_model=256, n_heads=8),
    # Room for bigger ones (GPT-2 shapes with a byte-level vocabulary).
    "medium": GPTConfig(name="medium", seq_len=256, n_layers=12, d_model=512, n_heads=8),
    "gpt2-124m-bytes": GPTConfig(name="gpt2-124m-bytes", seq_len=512, n_layers=12, d_model=768, n_heads=12),
}


def get_model_config(name: str) -> GPTConfig:
    """The named config, or an `UnknownModelError` that lists the known names."""
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        known = ", ".join(sorted(MODEL_CONFIGS))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None
