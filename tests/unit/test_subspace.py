"""Subspace compression at stage boundaries (models/subspace.py, issue #27): the split model is the
unsplit one with the same option, the learned projections stay orthonormal, a fixed-subspace model
folds into plain weights, and the options are checked and fingerprinted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.config import get_model_config, with_subspace
from models.identity import model_fingerprint
from models.stages import (
    StageSplitError,
    boundary_width,
    build_full_model,
    build_stage,
    equal_boundaries,
)
from models.subspace import fold_fixed_subspace

SEED = 3


def _batch(config, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _run_split(stages, tokens, targets):
    """Loss through the stages, each boundary tensor detached as the wire detaches it; backward
    through every stage with the received gradients. Returns the loss and the boundary widths."""
    outputs, inputs, widths = [], [], []
    x = tokens
    for stage in stages[:-1]:
        out = stage(x, tokens=tokens)
        widths.append(out.shape[-1])
        x = out.detach().requires_grad_(True)
        outputs.append(out)
        inputs.append(x)
    loss = stages[-1](x, targets, tokens=tokens)
    loss.backward()
    for out, received in reversed(list(zip(outputs, inputs))):
        out.backward(received.grad)
    return loss, widths


def _global_name(stage, name: str) -> str:
    if name.startswith("blocks."):
        index, rest = name.split(".", 2)[1:]
        return f"blocks.{int(index) + stage.spec.first_layer}.{rest}"
    return name


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("kind", ["fixed", "learned"])
@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_split_equals_unsplit(model, kind, num_stages):
    config = with_subspace(get_model_config(model), 8, kind)
    boundaries = equal_boundaries(config.n_layers, num_stages)
    full = build_full_model(config, SEED, boundaries)
    stages = [build_stage(config, i, num_stages, SEED) for i in range(num_stages)]
    tokens, targets = _batch(config)
    full_loss = full(tokens, targets)
    full_loss.backward()
    pipe_loss, widths = _run_split(stages, tokens, targets)
    assert widths == [8] * (num_stages - 1)  # only K coefficients per token cross
    torch.testing.assert_close(pipe_loss, full_loss, rtol=1e-5, atol=1e-6)
    full_params = dict(full.named_parameters())
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            name = _global_name(stage, name)
            seen.add(name)
            torch.testing.assert_close(p.grad, full_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert seen == set(full_params)  # the stages hold exactly the whole model's parameters


def test_fixed_subspace_keeps_the_plain_models_parameters():
    plain = get_model_config("tiny")
    fixed = with_subspace(plain, 8, "fixed")
    plain_state, fixed_state = build_stage(plain, 1, 3, SEED).state_dict(), build_stage(fixed, 1, 3, SEED).state_dict()
    assert plain_state.keys() == fixed_state.keys()
    assert all(torch.equal(plain_state[k], fixed_state[k]) for k in plain_state)  # same initial weights


def test_off_ignores_tokens_and_is_todays_model():
    config = get_model_config("tiny")
    assert with_subspace(config, 0) == config
    assert model_fingerprint(with_subspace(config, 0, "learned")) == model_fingerprint(config)
    stage = build_stage(config, 1, 3, SEED)
    assert not stage.needs_tokens
    hidden = torch.randn(2, config.seq_len, config.d_model, generator=torch.Generator().manual_seed(1))
    tokens, _ = _batch(config)
    assert torch.equal(stage(hidden), stage(hidden, tokens=tokens))
    assert stage.expected_input(2) == ((2, config.seq_len, config.d_model), torch.float32)
    assert boundary_width(config) == config.d_model


@pytest.mark.parametrize("kind", ["fixed", "learned"])
def test_stages_after_the_first_need_the_token_ids(kind):
    config = with_subspace(get_model_config("tiny"), 8, kind)
    first, middle = build_stage(config, 0, 3, SEED), build_stage(config, 1, 3, SEED)
    assert not first.needs_tokens and middle.needs_tokens
    assert middle.expected_input(4) == ((4, config.seq_len, 8), torch.float32)
    assert first.expected_input(4) == ((4, config.seq_len), torch.int64)
    assert boundary_width(config) == 8
    with pytest.raises(ValueError, match="token ids"):
        middle(torch.zeros(2, config.seq_len, 8))


def test_learned_projections_stay_orthonormal_under_adamw():
    config = with_subspace(get_model_config("tiny"), 8, "learned")
    full = build_full_model(config, SEED, equal_boundaries(config.n_layers, 3))
    optimizer = torch.optim.AdamW(full.parameters(), lr=5e-2, weight_decay=0.1)
    matrices = lambda: [m.matrix for m in (*full.boundary_down.values(), *full.boundary_up.values())]  # noqa: E731
    before = [p.detach().clone() for p in matrices()]
    for step in range(5):
        optimizer.zero_grad()
        full(*_batch(config, step)).backward()
        optimizer.step()
    after = matrices()
    assert len(after) == 4  # a projection and a lift at each of the 2 boundaries
    for p, p0 in zip(after, before):
        torch.testing.assert_close(p.T @ p, torch.eye(8), rtol=0, atol=1e-5)
        assert (p - p0).abs().max() > 1e-3  # it did train


def test_learned_sender_and_receiver_start_equal_with_zero_anchors():
    config = with_subspace(get_model_config("tiny"), 8, "learned")
    sender, receiver = build_stage(config, 0, 2, SEED), build_stage(config, 1, 2, SEED)
    b = str(sender.spec.last_layer)
    torch.testing.assert_close(sender.boundary_down[b].matrix, receiver.boundary_up[b].matrix)
    assert not receiver.boundary_up[b].anchors.weight.any()


def test_learned_full_model_needs_the_boundaries():
    config = with_subspace(get_model_config("tiny"), 8, "learned")
    with pytest.raises(StageSplitError, match="boundaries"):
        build_full_model(config, SEED)


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_fixed_subspace_folds_into_a_plain_model(model):
    config = with_subspace(get_model_config(model), 8, "fixed")
    trained = build_full_model(config, SEED)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    for step in range(3):  # weights away from their initialisation
        optimizer.zero_grad()
        trained(*_batch(config, step)).backward()
        optimizer.step()
    plain_config = with_subspace(config, 0)
    plain = build_full_model(plain_config, seed=99)
    plain.load_state_dict(fold_fixed_subspace(config, trained.state_dict(), SEED))
    tokens, targets = _batch(config, 7)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens, targets), trained(tokens, targets), rtol=1e-5, atol=1e-6)


def test_fold_refuses_other_models():
    with pytest.raises(ValueError, match="fixed"):
        fold_fixed_subspace(get_model_config("tiny"), {}, SEED)


@pytest.mark.parametrize(
    ("rank", "kind", "message"),
    [
        (-1, "fixed", "between 1 and d_model"),
        (33, "fixed", "between 1 and d_model"),
        (8, "pca", "unknown subspace kind"),
    ],
)
def test_bad_options_are_refused(rank, kind, message):
    with pytest.raises(ValueError, match=message):
        with_subspace(get_model_config("tiny"), rank, kind)


def test_user_architecture_refuses_subspace():
    config = get_model_config("tiny")
    user = dataclasses.replace(config, arch="user", user_model="pkg.mod:fn", part_parameters=(1, 1, 1))
    with pytest.raises(ValueError, match="not arch 'user'"):
        with_subspace(user, 8)


def test_subspace_options_enter_the_fingerprint():
    config = get_model_config("tiny")
    prints = {
        model_fingerprint(config),
        model_fingerprint(with_subspace(config, 8, "fixed")),
        model_fingerprint(with_subspace(config, 16, "fixed")),
        model_fingerprint(with_subspace(config, 8, "learned")),
    }
    assert len(prints) == 4


def test_a_subspace_config_has_no_transformers_config():
    from models.hf_config import ModelFolderError, to_hf_config

    config = get_model_config("tiny")
    assert to_hf_config(with_subspace(config, 0))["n_embd"] == config.d_model
    with pytest.raises(ModelFolderError, match="fold_fixed_subspace"):
        to_hf_config(with_subspace(config, 8, "fixed"))
