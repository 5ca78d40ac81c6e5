"""config.json of Hugging Face GPT-2 and Llama folders <-> `GPTConfig` (models/hf_format.py reads
and writes the folders). Absent keys take transformers' defaults; an option the project's blocks do
not compute is refused with a `ModelFolderError` that names it."""

from __future__ import annotations

from dataclasses import replace

from models.config import GPTConfig

SUPPORTED_MODEL_TYPES = {"gpt2": "gpt", "llama": "llama"}
_GELU_NAMES = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


class ModelFolderError(ValueError):
    """A folder that is not a usable Hugging Face model folder (one line says why)."""


def to_hf_config(config: GPTConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """The `config.json` transformers reads for `config` (untied head, float32 weights). A
    subspace-compressed config is refused: transformers has no such layer (fold a fixed subspace
    into plain weights first, models/subspace.py `fold_fixed_subspace`, and export rank 0)."""
    if config.subspace_rank:
        raise ModelFolderError(
            f"{config.name}: a {config.subspace_kind} subspace (rank {config.subspace_rank}) has no transformers "
            "layout; fold a fixed subspace into plain weights (models.subspace.fold_fixed_subspace) and export "
            "subspace_rank=0"
        )
    common = {
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,  # the head is a tensor of its own (see the module docstring)
        "dtype": "float32",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if config.arch == "gpt":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_positions": config.seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layers,
            "n_head": config.n_heads,
            "n_inner": config.hidden_size,
            "activation_function": "gelu" if config.activation == "gelu" else "gelu_new",
            "layer_norm_epsilon": config.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            **common,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.d_model,
        "intermediate_size": config.hidden_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        **common,
    }


def _refuse_unless(condition: bool, name: str, what: str) -> None:
    if not condition:
        raise ModelFolderError(f"{name}: {what}, which swarm's blocks do not compute")


def from_hf_config(data: dict, *, name: str) -> GPTConfig:
    """The GPTConfig of a `config.json` (absent keys take transformers' defaults). Raises
    ModelFolderError for a model type or an option the project's blocks do not compute."""
    config = _from_hf_config(data, name=name)
    if config.mlp_hidden is not None and replace(config, mlp_hidden=None).hidden_size == config.mlp_hidden:
        config = replace(config, mlp_hidden=None)  # one spelling per model, so its fingerprint is one
    return config


def _from_hf_config(data: dict, *, name: str) -> GPTConfig:
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(f"{t} ({cls})" for t, cls in [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
        raise ModelFolderError(f"{name}: model_type {model_type!r} is not supported; supported: {supported}")
    try:
        if model_type == "gpt2":
            activation = data.get("activation_function", "gelu_new")
            _refuse_unless(activation in _GELU_NAMES, name, f"activation_function {activation!r}")
            _refuse_unless(data.get("scale_attn_weights", True), name, "scale_attn_weights is false")
            _refuse_unless(
                not data.get("scale_attn_by_inverse_layer_idx", False), name, "scale_attn_by_inverse_layer_idx"
            )
            _refuse_unless(not data.get("add_cross_attention", False), name, "add_cross_attention")
            return GPTConfig(
                name=name,
                arch="gpt",
                vocab_size=int(data.get("vocab_size", 50257)),
                seq_len=int(data.get("n_positions", 1024)),
                n_layers=int(data.get("n_layer", 12)),
                d_model=int(data.get("n_embd", 768)),
                n_heads=int(data.get("n_head", 12)),
                mlp_hidden=int(data["n_inner"]) if data.get("n_inner") is not None else None,
                norm_eps=float(data.get("layer_norm_epsilon", 1e-5)),
                activation=_GELU_NAMES[activation],
            )
        heads = int(data.get("num_attention_heads", 32))
        d_model = int(data.get("hidden_size", 4096))
        kv_heads = int(data.get("num_key_value_heads") or heads)
        _refuse_unless(
            kv_heads > 0 and heads % kv_heads == 0,
            name,
            f"num_key_value_heads={kv_heads} that does not divide num_attention_heads={heads}",
        )
        _refuse_unless(
            data.get("head_dim") in (None, d_model // heads), name, f"head_dim {data.get('head_dim')} != hidden/heads"
        )
        _refuse_unless(data.get("hidden_act", "silu") == "silu", name, f"hidden_act {data.get('hidden_act')!r}")
        _refuse_unless(not data.get("attention_bias", False), name, "attention_bias")
        _refuse_unless(not data.get("mlp_bias", False), name, "mlp_bias")
        rope = data.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        _refuse_unless(rope_type == "default" and not data.get("rope_scaling"), name, f"rope scaling {rope_type!r}")
        return GPTConfig(
            name=name,
            arch="llama",
            vocab_size=int(data.get("vocab_size", 32000)),
            seq_len=int(data.get("max_position_embeddings", 2048)),
            n_layers=int(data.get("num_hidden_layers", 32)),
            d_model=d_model,
            n_heads=heads,
            mlp_hidden=int(data.get("intermediate_size", 11008)),
            norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_base=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            n_kv_heads=None if kv_heads == heads else kv_heads,
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelFolderError):
            raise
        raise ModelFolderError(f"{name}: config.json has an unusable value: {e}") from None


def is_tied(data: dict) -> bool:
    """Whether a config.json ties the head to the token embedding (transformers' default per type)."""
    return bool(data.get("tie_word_embeddings", data.get("model_type") == "gpt2"))
