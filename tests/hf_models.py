"""Small random Hugging Face models made with transformers in the test (nothing downloaded), saved
as model folders: the inputs of the --model-dir tests (and of export tests that compare with
transformers)."""

from __future__ import annotations

import torch

KINDS = ("gpt2", "gpt2-tied", "gpt2-tanh-untied", "llama", "llama-gqa-tied")


def make_hf_folder(path, kind: str, *, vocab: int = 101, seq_len: int = 16, layers: int = 3, shard: bool = False):
    """A random transformers model of `kind` saved to `path` (sharded in 20 kB files with `shard`);
    returns the model in eval mode. "gpt2": exact GELU, untied head; "gpt2-tied": GPT-2's defaults
    (tanh GELU, head tied to the embedding); "gpt2-tanh-untied"; "llama": multi-head attention;
    "llama-gqa-tied": 2 key/value heads for 4 heads and a head tied to the embedding (as SmolLM)."""
    import transformers

    torch.manual_seed(0)
    if kind.startswith("gpt2"):
        config = transformers.GPT2Config(
            n_embd=32,
            n_layer=layers,
            n_head=4,
            vocab_size=vocab,
            n_positions=seq_len,
            tie_word_embeddings=kind == "gpt2-tied",
            activation_function="gelu" if kind == "gpt2" else "gelu_new",
            bos_token_id=None,
            eos_token_id=None,
        )
        model = transformers.GPT2LMHeadModel(config)
    elif kind.startswith("llama"):
        config = transformers.LlamaConfig(
            hidden_size=32,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2 if kind == "llama-gqa-tied" else 4,
            tie_word_embeddings=kind == "llama-gqa-tied",
            intermediate_size=48,
            vocab_size=vocab,
            max_position_embeddings=seq_len,
            rope_theta=500.0,
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    with torch.no_grad():
        # transformers' init (std 0.02, zero biases, unit norms) gives near-uniform predictions, whose
        # loss hardly depends on the weights: larger random weights make a wrong mapping show.
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(str(path), max_shard_size="20KB" if shard else "5GB")
    return model
