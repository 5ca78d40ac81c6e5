"""`swarm export` of a run trained with adapters (swarm/export/adapters.py): the checkpoints hold
only the adapters; the export rebuilds the base and merges them (W + B @ A), or writes them apart."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from models.config import get_model_config
from models.hf_format import read_model_folder
from models.lora import merge_adapters
from models.stages import build_full_model
from peers.compute.checkpoint import checkpoint_path
from peers.compute.stage_runtime import StageRuntime
from swarm.export.adapters import ADAPTER_CONFIG_FILE, ADAPTERS_FILE
from swarm.export.assemble import ExportError
from swarm.export.config import ExportConfig
from swarm.export.run import run_export

pytest.importorskip("peft")

RANK = 4
LORA = dataclasses.replace(get_model_config("tiny"), trainable=f"lora:{RANK}")


def trained_stages(folder) -> list[StageRuntime]:
    """Two stages with adapters whose B is no longer zero, saved as a run's exit checkpoints."""
    stages = [StageRuntime(LORA, s, 2, seed=0) for s in range(2)]
    generator = torch.Generator().manual_seed(7)
    for runtime in stages:
        runtime.use_adapters()
        with torch.no_grad():
            for name, p in runtime.module.named_parameters():
                if ".lora_" in name:
                    p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        runtime.save(checkpoint_path(str(folder), "tiny", runtime.stage, 2), "tiny")
    return stages


def export(tmp_path, out: str, **kwargs):
    config = ExportConfig(model="tiny", checkpoint_dir=[str(tmp_path / "ckpt")], out=str(tmp_path / out), **kwargs)
    return run_export(config, say=lambda line: None)


def test_the_export_merges_the_adapters_into_the_seeded_base(tmp_path):
    stages = trained_stages(tmp_path / "ckpt")
    result = export(tmp_path, "merged")
    assert result.config.trainable == "all"
    _, loaded = read_model_folder(result.out)
    # The exported model computes what the adapted stages compute.
    tokens = torch.randint(0, 256, (2, LORA.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = stages[1].module(stages[0].module(tokens), tokens)
        torch.testing.assert_close(loaded(tokens, tokens), expected, atol=1e-5, rtol=0)
    # And its weights are base + B @ A, tensor by tensor.
    base = build_full_model(get_model_config("tiny")).state_dict()
    adapters = load_file(export(tmp_path, "apart", adapters_only=True).out + "/" + ADAPTERS_FILE)
    want = merge_adapters(base, adapters)
    got = loaded.state_dict()
    assert any(not torch.equal(want[n], base[n]) for n in want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=0, msg=name)


def test_adapters_only_writes_the_adapters_in_whole_model_names(tmp_path):
    trained_stages(tmp_path / "ckpt")
    result = export(tmp_path, "adapters", adapters_only=True)
    assert sorted(os.listdir(result.out)) == sorted([ADAPTERS_FILE, ADAPTER_CONFIG_FILE])
    tensors = load_file(os.path.join(result.out, ADAPTERS_FILE))
    blocks = {int(name.split(".")[1]) for name in tensors}
    assert blocks == set(range(LORA.n_layers)) and all(".lora_" in name for name in tensors)
    meta = json.loads(open(os.path.join(result.out, ADAPTER_CONFIG_FILE)).read())
    assert (meta["r"], meta["scale"]) == (RANK, 1.0)
    with pytest.raises(ExportError, match="already exists"):
        export(tmp_path, "adapters", adapters_only=True)


def test_adapters_only_is_refused_for_a_run_without_adapters(tmp_path):
    for s in range(2):
        full = StageRuntime(get_model_config("tiny"), s, 2)
        full.save(checkpoint_path(str(tmp_path / "ckpt"), "tiny", s, 2), "tiny")
    with pytest.raises(ExportError, match="hold full weights"):
        export(tmp_path, "x", adapters_only=True)
    assert not (tmp_path / "x").exists()
