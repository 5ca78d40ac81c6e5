"""The workload estimator's record and measurements, and stages built from explicit boundaries."""

from __future__ import annotations

import json

import pytest
import torch

from models.balanced_split import SplitCosts, balanced_split
from models.config import get_model_config
from models.layer_costs import LayerKind, ModelProfile, ProfileError, split_costs
from models.profile import profile_model
from models.stages import (
    StageSplitError,
    build_full_model,
    build_stage,
    equal_boundaries,
    split_from_boundaries,
    stage_spec,
)


@pytest.fixture(scope="module")
def tiny_profile() -> ModelProfile:
    return profile_model(get_model_config("tiny"), batch_size=2, repeats=2, warmup=1)


def test_profile_is_the_chain_of_the_model_with_its_sizes(tiny_profile):
    config = get_model_config("tiny")
    assert [layer.name for layer in tiny_profile.layers] == ["embedding", "block.0", "block.1", "block.2", "head"]
    assert [layer.kind for layer in tiny_profile.layers] == [
        LayerKind.EMBEDDING,
        *[LayerKind.BLOCK] * 3,
        LayerKind.HEAD,
    ]
    assert sum(layer.parameters for layer in tiny_profile.layers) == config.num_parameters()
    for layer in tiny_profile.layers:
        assert layer.forward_s > 0 and layer.backward_s > 0
        assert layer.parameter_bytes == 4 * layer.parameters == layer.gradient_bytes
        assert layer.optimizer_bytes == 2 * layer.parameter_bytes  # AdamW: two fp32 moments
    activation = 2 * config.seq_len * config.d_model * 4  # (B, T, C) float32
    assert [layer.output_bytes for layer in tiny_profile.layers[:-1]] == [activation] * 4
    assert tiny_profile.head.output_bytes == 4  # the loss
    assert tiny_profile.boundary_activation_bytes_per_sample((0, 1, 3)) == (activation / 2,)


def test_stage_sizes_follow_the_split(tiny_profile):
    layers = tiny_profile.layers
    grads = tiny_profile.stage_gradient_bytes((0, 1, 3))
    assert grads == (
        layers[0].gradient_bytes + layers[1].gradient_bytes,
        layers[2].gradient_bytes + layers[3].gradient_bytes + layers[4].gradient_bytes,
    )
    assert sum(tiny_profile.stage_memory_bytes((0, 2, 3))) == sum(layer.memory_bytes for layer in layers)
    with pytest.raises(ProfileError, match="strictly increase"):
        tiny_profile.stage_gradient_bytes((0, 3, 3))


def test_profile_round_trips_through_json_and_ignores_extra_keys(tiny_profile, tmp_path):
    path = tmp_path / "profile.json"
    tiny_profile.write(path, extra={"suggested_split": {"boundaries": [0, 1, 3]}})
    assert ModelProfile.read(path) == tiny_profile
    assert json.loads(path.read_text())["suggested_split"] == {"boundaries": [0, 1, 3]}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["layers"].pop(1), "3 blocks"),
        (lambda d: d["layers"].reverse(), "in that order"),
        (lambda d: d["layers"][1].update(forward_s=-1.0), "forward_s"),
        (lambda d: d["layers"][1].update(parameters="many"), "parameters"),
        (lambda d: d.pop("batch_size"), "batch_size"),
    ],
)
def test_malformed_profiles_are_refused_with_one_line(tiny_profile, tmp_path, mutate, message):
    data = tiny_profile.to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message) as error:
        ModelProfile.read(path)
    assert "\n" not in str(error.value)


def test_unreadable_profiles_say_why(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        ModelProfile.read(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        ModelProfile.read(tmp_path / "bad.json")


def test_split_costs_feed_the_splitter(tiny_profile):
    costs = split_costs(tiny_profile)
    assert costs.block_s == tuple(b.forward_s + b.backward_s for b in tiny_profile.blocks)
    assert costs.first_extra_s == tiny_profile.embedding.compute_s
    assert costs.last_extra_s == tiny_profile.head.compute_s
    assert costs.cut_s is None
    with_link = split_costs(tiny_profile, link_bytes_per_s=1e6)
    assert with_link.cut_s == (2 * tiny_profile.blocks[0].output_bytes / 1e6,) * 2
    assert len(balanced_split(with_link, 2).boundaries) == 3
    with pytest.raises(ProfileError):
        split_costs(tiny_profile, link_bytes_per_s=0)


@pytest.mark.parametrize("n_layers", range(1, 13))
def test_equal_costs_reproduce_the_equal_split(n_layers):
    for num_stages in range(1, n_layers + 1):
        split = balanced_split(SplitCosts(block_s=(1.0,) * n_layers), num_stages)
        assert split.boundaries == equal_boundaries(n_layers, num_stages)


def test_any_split_of_one_seed_holds_the_weights_of_the_whole_model():
    config = get_model_config("tiny")
    whole = dict(build_full_model(config, seed=3).named_parameters())
    for boundaries in [(0, 1, 3), (0, 2, 3), (0, 1, 2, 3)]:
        num_stages = len(boundaries) - 1
        seen = set()
        for stage in range(num_stages):
            module = build_stage(config, stage, num_stages, seed=3, boundaries=boundaries)
            offset = boundaries[stage]
            assert len(module.blocks) == boundaries[stage + 1] - offset
            for name, value in module.named_parameters():
                if name.startswith("blocks."):
                    index = int(name.split(".")[1]) + offset
                    name = f"blocks.{index}." + name.split(".", 2)[2]
                assert torch.equal(value, whole[name]), name
                seen.add(name)
        assert seen == set(whole)


@pytest.mark.parametrize(
    "boundaries, message",
    [
        ((0, 3, 3), "strictly increase"),
        ((1, 3), "start at 0"),
        ((0, 2), "end at n_layers=3"),
        ((0,), "at least two"),
    ],
)
def test_bad_boundaries_are_refused(boundaries, message):
    with pytest.raises(StageSplitError, match=message):
        split_from_boundaries(3, boundaries)


def test_boundaries_must_match_the_number_of_stages():
    config = get_model_config("tiny")
    with pytest.raises(StageSplitError, match="describe 2 stages, not 3"):
        stage_spec(config, 0, 3, boundaries=(0, 1, 3))
    assert stage_spec(config, 1, 2, boundaries=(0, 1, 3)).layers == range(1, 3)
