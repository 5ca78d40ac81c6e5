"""Model configurations: one frozen dataclass, and the named configs the CLI accepts."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace


class UnknownModelError(ValueError):
    """Raised for a model name that is not in `MODEL_CONFIGS`."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A decoder-only transformer: nanoGPT-like ("gpt") or LLaMA-like ("llama").

    vocab_size: tokens in the vocabulary (256 for byte-level text).
    seq_len: context length in tokens; every microbatch is (batch, seq_len).
    n_layers: transformer blocks, split across pipeline stages.
    d_model: width of the residual stream.
    n_heads: attention heads; d_model must be divisible by it.
    mlp_ratio: hidden width of the MLP as a multiple of d_model.
    dropout: kept at 0 so a pipeline and one process compute the same thing.
    arch: "gpt" (LayerNorm, learned positions, GELU MLP, biases) or "llama" (RMSNorm, rotary
        position embeddings, SwiGLU MLP, no biases); see models/gpt.py and models/llama.py.
    mlp_hidden: hidden width of the MLP; default mlp_ratio * d_model ("gpt") or the LLaMA rule
        (8/3 * d_model rounded up to a multiple of 256) for "llama".
    rope_base: base of the rotary frequencies ("llama" only; `rope_theta` in transformers).
    n_kv_heads: key/value heads ("llama" only): fewer than n_heads is grouped-query attention
        (each key/value head serves n_heads / n_kv_heads query heads); None = n_heads.
    norm_eps: epsilon of every LayerNorm ("gpt") or RMSNorm ("llama").
    activation: the GELU of the "gpt" MLP: "gelu" (exact, erf) or "gelu_tanh" (the tanh
        approximation GPT-2 checkpoints use, `gelu_new` in transformers).

    user_model: "package.module:function" for arch "user", an architecture of the user's own
        (models/interface.py); its sizes come from the function.
    code_hash: hash of the user architecture's definition (models/interface.py `definition_hash`).
    part_parameters: parameters of the user architecture's (embedding, one block, head).
    trainable: "all" (full training) or "lora:R" (rank-R LoRA adapters on the blocks, base weights
        frozen; models/lora.py). Part of the config so that the fingerprint peers announce keeps
        peers of different modes apart.
    subspace_rank: K > 0 compresses every stage boundary to K coefficients per token (0 = off):
        models/subspace.py. "gpt" and "llama" only.
    subspace_kind: "fixed" (one shared basis every block writes into, Pluralis' subspace networks)
        or "learned" (an orthonormal projection per stage boundary and token anchors, MAPL).

    With these fields the blocks compute exactly what transformers' `GPT2LMHeadModel` and
    `LlamaForCausalLM` compute for the same weights (models/hf_format.py converts the names).
    """

    name: str
    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 6
    d_model: int = 256
    n_heads: int = 8
    mlp_ratio: int = 4
    dropout: float = 0.0
    arch: str = "gpt"
    mlp_hidden: int | None = None
    rope_base: float = 10000.0
    n_kv_heads: int | None = None
    norm_eps: float = 1e-5
    activation: str = "gelu"
    user_model: str = ""
    code_hash: str = ""
    part_parameters: tuple[int, int, int] | None = None
    trainable: str = "all"
    subspace_rank: int = 0
    subspace_kind: str = "fixed"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; use one of {', '.join(ARCHITECTURES)}")
        if (self.arch == "user") != bool(self.user_model) or (self.arch == "user") != (
            self.part_parameters is not None
        ):
            raise ValueError("arch 'user' goes with user_model and part_parameters, and only it")
        lora_rank(self.trainable)  # ValueError for anything but "all" or "lora:R"
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if min(self.vocab_size, self.seq_len, self.n_layers, self.d_model, self.n_heads, self.hidden_size) <= 0:
            raise ValueError(f"model config {self.name!r} has a non-positive size")
        if self.n_kv_heads is not None:
            if self.arch != "llama":
                raise ValueError("n_kv_heads (grouped-query attention) is only for the llama architecture")
            if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; use one of {', '.join(ACTIVATIONS)}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        self._check_subspace()

    def _check_subspace(self) -> None:
        if self.subspace_kind not in SUBSPACE_KINDS:
            raise ValueError(f"unknown subspace kind {self.subspace_kind!r}; use one of {', '.join(SUBSPACE_KINDS)}")
        if isinstance(self.subspace_rank, bool) or not isinstance(self.subspace_rank, int):
            raise ValueError(f"subspace rank must be an integer, got {self.subspace_rank!r}")
        if self.subspace_rank == 0:
            return
        if not 0 < self.subspace_rank <= self.d_model:
            raise ValueError(
                f"subspace rank must be 0 (off) or between 1 and d_model={self.d_model}, got {self.subspace_rank}"
            )
        if self.arch == "user":
            raise ValueError("subspace compression is for the gpt and llama architectures, not arch 'user'")

    @property
    def hidden_size(self) -> int:
        """Hidden width of the MLP (of each of SwiGLU's gate and up projections for "llama")."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.arch == "llama":
            return 256 * -(-(8 * self.d_model // 3) // 256)
        return self.mlp_ratio * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_heads, or fewer with grouped-query attention."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def block_parameters(self) -> int:
        """Parameters of one transformer block."""
        if self.part_parameters is not None:
            return self.part_parameters[1]
        d, h = self.d_model, self.hidden_size
        if self.arch == "llama":  # q, o; k, v (fewer rows with grouped-query attention); gate, up, down; two norms
            return 2 * d * d + 2 * d * self.kv_heads * self.head_dim + 3 * d * h + 2 * d
        return 4 * d * d + 4 * d + 2 * h * d + h + d + 4 * d  # attn (+biases), MLP (+biases), two LayerNorms

    def embedding_parameters(self) -> int:
        if self.part_parameters is not None:
            return self.part_parameters[0]
        positions = 0 if self.arch == "llama" else self.seq_len * self.d_model
        return self.vocab_size * self.d_model + positions

    def head_parameters(self) -> int:
        if self.part_parameters is not None:
            return self.part_parameters[2]
        if self.arch == "llama":  # RMSNorm weight, projection without bias
            return self.d_model + self.d_model * self.vocab_size
        return 2 * self.d_model + self.d_model * self.vocab_size  # LayerNorm; projection without bias (as GPT-2)

    def num_parameters(self) -> int:
        """Parameter count of the whole model (embeddings, blocks, final norm and head; the head is
        not tied to the embedding, since they live on different stages)."""
        return self.embedding_parameters() + self.n_layers * self.block_parameters() + self.head_parameters()

    def to_dict(self) -> dict:
        return asdict(self)


ARCHITECTURES = ("gpt", "llama", "user")
ACTIVATIONS = ("gelu", "gelu_tanh")
SUBSPACE_KINDS = ("fixed", "learned")


def with_subspace(config: GPTConfig, rank: int, kind: str = "fixed") -> GPTConfig:
    """`config` with subspace compression at rank `rank` (0 = off) of `kind`; ValueError in one
    line for a rank outside 0..d_model, an unknown kind or a user architecture."""
    return replace(config, subspace_rank=rank, subspace_kind=kind)


def lora_rank(trainable: str) -> int | None:
    """None for "all", R for "lora:R" (R >= 1); ValueError otherwise."""
    if trainable == "all":
        return None
    kind, _, rank = trainable.partition(":")
    if kind != "lora" or not rank.isdigit() or int(rank) < 1:
        raise ValueError(f"--trainable {trainable!r}: use all or lora:R with a rank R >= 1 (e.g. lora:8)")
    return int(rank)


GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary size; byte-level data (ids < 256) fits in it

MODEL_CONFIGS: dict[str, GPTConfig] = {
    # For tests: trains in seconds on one core.
    "tiny": GPTConfig(name="tiny", seq_len=32, n_layers=3, d_model=32, n_heads=4),
    # For the demo and loopback benchmarks: ~4.9M parameters.
    "small": GPTConfig(name="small", seq_len=128, n_layers=6, d_model=256, n_heads=8),
    # Room for bigger ones (GPT-2 shapes with a byte-level vocabulary).
    "medium": GPTConfig(name="medium", seq_len=256, n_layers=12, d_model=512, n_heads=8),
    "gpt2-124m-bytes": GPTConfig(name="gpt2-124m-bytes", seq_len=512, n_layers=12, d_model=768, n_heads=12),
    # GPT-2 shapes with GPT-2's vocabulary and context. GPT-2 ties its head to the embedding; here
    # they sit on different stages, so the untied head adds vocab * d_model: 124M -> 163M,
    # 350M -> 407M, 774M -> 838M parameters in total (see `num_parameters`).
    "gpt2-124m": GPTConfig(name="gpt2-124m", vocab_size=GPT2_VOCAB, seq_len=1024, n_layers=12, d_model=768, n_heads=12),
    "gpt2-350m": GPTConfig(
        name="gpt2-350m", vocab_size=GPT2_VOCAB, seq_len=1024, n_layers=24, d_model=1024, n_heads=16
    ),
    "gpt2-774m": GPTConfig(
        name="gpt2-774m", vocab_size=GPT2_VOCAB, seq_len=1024, n_layers=36, d_model=1280, n_heads=20
    ),
    # LLaMA-style blocks (RMSNorm, rotary, SwiGLU), a 32k vocabulary, multi-head attention (no GQA).
    # llama-tiny is for tests; llama-1b has 16 blocks of d=2048 (~0.95B parameters).
    "llama-tiny": GPTConfig(name="llama-tiny", arch="llama", seq_len=32, n_layers=3, d_model=32, n_heads=4),
    "llama-1b": GPTConfig(
        name="llama-1b",
        arch="llama",
        vocab_size=32000,
        seq_len=2048,
        n_layers=16,
        d_model=2048,
        n_heads=32,
        mlp_hidden=5632,
    ),
}


def model_names_help() -> str:
    """The built-in models, for a --model flag's help."""
    return (
        f"a built-in model ({', '.join(MODEL_CONFIGS)}), module.path:function (your own) or, with --model-dir, its name"
    )


def get_model_config(name: str) -> GPTConfig:
    """The named config, or an `UnknownModelError` that lists the known names. A name of the form
    `package.module:function` is a user architecture (models/interface.py; UserModelError)."""
    if ":" in name:
        return _user_config(name)
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        known = ", ".join(sorted(MODEL_CONFIGS))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


@functools.lru_cache(maxsize=16)
def _user_config(reference: str) -> GPTConfig:
    from models.interface import check_parts, definition_hash, load_model_parts

    parts = load_model_parts(reference)
    counts = check_parts(reference, parts)
    return GPTConfig(
        name=reference,
        arch="user",
        vocab_size=parts.vocab_size,
        seq_len=parts.seq_len,
        n_layers=parts.n_layers,
        d_model=parts.d_model,
        n_heads=1,
        user_model=reference,
        code_hash=definition_hash(reference),
        part_parameters=counts,
    )
