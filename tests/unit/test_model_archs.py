"""The bigger named configs and the LLaMA-style block: parameter counts, splits, and a 2-stage
pipeline that computes exactly what the whole model computes (tiny versions of the shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.config import MODEL_CONFIGS, GPTConfig, get_model_config
from models.llama import RMSNorm, apply_rotary, rotary_tables
from models.stages import build_full_model, build_stage, split_layers


def tiny_version(name: str) -> GPTConfig:
    """The named config's architecture with a test-sized shape."""
    config = get_model_config(name)
    return dataclasses.replace(
        config,
        name=f"{name}-test",
        vocab_size=300,
        seq_len=16,
        n_layers=4,
        d_model=32,
        n_heads=4,
        mlp_hidden=None if config.mlp_hidden is None else 48,
    )


NEW_CONFIGS = ["gpt2-124m", "gpt2-350m", "gpt2-774m", "llama-1b"]


def test_named_shapes_have_the_advertised_sizes():
    counts = {name: get_model_config(name).num_parameters() for name in NEW_CONFIGS}
    # GPT-2's published sizes count the head tied to the embedding; ours is untied (+vocab * d).
    for name, published in [("gpt2-124m", 124.4e6), ("gpt2-350m", 354.8e6), ("gpt2-774m", 774.0e6)]:
        config = get_model_config(name)
        tied = counts[name] - config.vocab_size * config.d_model  # minus the head's weight
        assert abs(tied - published) / published < 0.01, (name, tied)
    assert 0.9e9 < counts["llama-1b"] < 1.0e9
    assert get_model_config("llama-1b").arch == "llama"


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "llama-gqa", *NEW_CONFIGS])
def test_parameter_count_formula_matches_the_modules(name):
    if name == "llama-gqa":  # grouped-query attention: 2 key/value heads for 4 query heads
        config = dataclasses.replace(get_model_config("llama-tiny"), n_kv_heads=2)
    else:
        config = tiny_version(name) if name in NEW_CONFIGS else get_model_config(name)
    model = build_full_model(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt2-774m", "llama-1b"])
def test_named_configs_split_into_stages(name):
    config = get_model_config(name)
    for num_stages in (2, 4, config.n_layers):
        specs = split_layers(config.n_layers, num_stages)
        assert [s.first_layer for s in specs][0] == 0 and specs[-1].last_layer == config.n_layers
        assert all(s.last_layer - s.first_layer >= 1 for s in specs)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-124m", "llama-1b"])
def test_two_stage_split_equals_the_full_model(name):
    config = tiny_version(name) if name in NEW_CONFIGS else get_model_config(name)
    full = build_full_model(config, seed=3)
    first, last = build_stage(config, 0, 2, seed=3), build_stage(config, 1, 2, seed=3)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(tokens, -1, dims=1)
    full_loss = full(tokens, targets)
    hidden = first(tokens)
    hidden_in = hidden.detach().requires_grad_(True)
    pipe_loss = last(hidden_in, targets)
    assert torch.equal(full_loss, pipe_loss)
    full_loss.backward()
    pipe_loss.backward()
    hidden.backward(hidden_in.grad)
    full_grads = dict(full.named_parameters())
    offset = first.spec.last_layer
    for stage in (first, last):
        for pname, p in stage.named_parameters():
            if pname.startswith("blocks.") and stage is last:
                index, rest = pname.split(".", 2)[1:]
                pname = f"blocks.{int(index) + offset}.{rest}"
            torch.testing.assert_close(p.grad, full_grads[pname].grad, rtol=1e-5, atol=1e-7, msg=pname)


def test_llama_stage_has_no_biases_and_no_learned_positions():
    config = get_model_config("llama-tiny")
    names = [n for n, _ in build_full_model(config).named_parameters()]
    assert not [n for n in names if n.endswith("bias")]
    assert not [n for n in names if "pos" in n]
    assert "blocks.0.mlp.gate.weight" in names


def test_rotary_is_a_rotation_that_depends_on_relative_position():
    cos, sin = rotary_tables(head_dim=8, seq_len=10, base=10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def at(x, position):  # x placed at `position` in a sequence of zeros
        seq = torch.zeros(1, 1, 10, 8)
        seq[:, :, position] = x[:, :, 0]
        return apply_rotary(seq, cos, sin)[:, :, position]

    assert torch.allclose(at(q, 3).norm(), q.norm())  # rotations keep the norm
    score_a = (at(q, 5) * at(k, 2)).sum()
    score_b = (at(q, 7) * at(k, 4)).sum()  # same distance, other absolute positions
    assert torch.allclose(score_a, score_b, atol=1e-5)
    assert not torch.allclose(score_a, (at(q, 7) * at(k, 2)).sum(), atol=1e-3)


def test_rmsnorm_normalises_and_keeps_the_dtype():
    norm = RMSNorm(16)
    x = torch.randn(3, 16) * 7
    y = norm(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(3), atol=1e-3)
    assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_unknown_architecture_is_refused():
    with pytest.raises(ValueError, match="unknown architecture"):
        GPTConfig(name="x", arch="mamba")
    assert set(MODEL_CONFIGS) >= {"gpt2-124m", "gpt2-350m", "gpt2-774m", "llama-1b", "llama-tiny"}
