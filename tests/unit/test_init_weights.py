"""--init-weights: a stage loads its slice of a whole-model safetensors file written here."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from models.config import get_model_config
from models.init_weights import InitWeightsError, global_name, load_stage_weights, save_full_weights
from models.stages import build_full_model, build_stage


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_each_stage_loads_its_slice_of_the_file(tmp_path, name):
    config = get_model_config(name)
    path = str(tmp_path / "init.safetensors")
    save_full_weights(build_full_model(config, seed=7), path)
    for stage in range(3):
        reference = build_stage(config, stage, 3, seed=7)
        module = build_stage(config, stage, 3, seed=0)  # other weights until loaded
        assert not all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), reference.state_dict().values()))
        assert load_stage_weights(module, path) == len(reference.state_dict())
        for (key, got), want in zip(module.state_dict().items(), reference.state_dict().values()):
            assert torch.equal(got, want), key


def test_global_names():
    assert global_name("blocks.0.mlp.up.weight", 4) == "blocks.4.mlp.up.weight"
    assert global_name("head.out.weight", 4) == "head.out.weight"


def test_wrong_files_are_refused_with_a_reason(tmp_path):
    config = get_model_config("tiny")
    module = build_stage(config, 1, 2)
    with pytest.raises(InitWeightsError, match="no such file"):
        load_stage_weights(module, str(tmp_path / "missing.safetensors"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(InitWeightsError, match="not a readable safetensors"):
        load_stage_weights(module, str(junk))
    other = str(tmp_path / "llama.safetensors")
    save_full_weights(build_full_model(get_model_config("llama-tiny")), other)
    with pytest.raises(InitWeightsError, match="has no tensor"):
        load_stage_weights(module, other)
    wide = {k: torch.zeros(*(s + 1 for s in v.shape)) for k, v in build_full_model(config).state_dict().items()}
    save_file(wide, str(tmp_path / "wide.safetensors"))
    with pytest.raises(InitWeightsError, match="has shape"):
        load_stage_weights(module, str(tmp_path / "wide.safetensors"))
