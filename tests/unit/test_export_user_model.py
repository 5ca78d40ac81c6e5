"""`swarm export` of a user architecture (`--model module.path:function`): no transformers class
can load it, so the folder holds the trained state as safetensors in the project's own naming
(what `--init-weights` reads) with `swarm.json`, and the export says so in one line."""

from __future__ import annotations

import json
import os

import torch

from models.config import get_model_config
from models.init_weights import load_stage_weights
from models.stages import build_stage
from peers.compute.checkpoint import CheckpointMeta, checkpoint_path, save_checkpoint
from swarm.export.config import ExportConfig
from swarm.export.run import USER_ARCHITECTURE_NOTE, run_export

MODEL = "tests.integration.test_user_model:mixer"


def test_a_user_architecture_exports_its_state_in_the_project_naming(tmp_path):
    config = get_model_config(MODEL)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(ckpt)
    trained = [build_stage(config, s, 2, seed=3) for s in range(2)]  # stands for trained weights
    for s, stage in enumerate(trained):
        save_checkpoint(checkpoint_path(ckpt, MODEL, s, 2), CheckpointMeta(MODEL, s, 2, 4), stage.state_dict(), {})
    lines = []
    result = run_export(ExportConfig(model=MODEL, checkpoint_dir=[ckpt], out=out), say=lines.append)

    assert result.steps_done == 4 and result.config.arch == "user"
    assert {"model.safetensors", "swarm.json"} <= set(os.listdir(out)) and "config.json" not in os.listdir(out)
    assert [line for line in lines if "note" in line] == [f"[export] note: {USER_ARCHITECTURE_NOTE}"]
    with open(os.path.join(out, "swarm.json")) as f:
        meta = json.load(f)
    assert meta["config"]["user_model"] == MODEL and meta["config"]["code_hash"] == config.code_hash
    assert meta["steps_done"] == 4
    # the file is what --init-weights reads: each stage loads back exactly what was exported
    for s, stage in enumerate(trained):
        fresh = build_stage(config, s, 2, seed=0)
        assert load_stage_weights(fresh, os.path.join(out, "model.safetensors")) == len(stage.state_dict())
        for name, value in stage.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], value), name
