"""Graceful degradation (issue #11): a disk that fills up while a checkpoint is written leaves the
previous checkpoint intact and loadable, and no temporary file behind."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from models.config import get_model_config
from peers.compute.checkpoint import load_checkpoint
from peers.compute.stage_runtime import StageRuntime


def test_a_full_disk_keeps_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    stage = StageRuntime(get_model_config("tiny"), 0, 2)
    path = str(tmp_path / "stage0.ckpt")
    stage.save(path, "tiny")
    before = open(path, "rb").read()
    with torch.no_grad():
        next(stage.module.parameters()).add_(1.0)  # the state moved on since

    def full_disk_fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk_fsync)
    with pytest.raises(OSError, match="No space left"):
        stage.save(path, "tiny")
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["stage0.ckpt"], "a temporary file was left behind"
    meta, module_state, _ = load_checkpoint(path)
    assert meta.model == "tiny" and meta.stage == 0


def test_a_nan_gradient_skips_the_step_instead_of_poisoning_the_weights(caplog):
    stage = StageRuntime(get_model_config("tiny"), 1, 2)
    before = [p.detach().clone() for p in stage.module.parameters()]
    inputs = torch.randn(2, stage.config.seq_len, stage.config.d_model)
    targets = torch.randint(0, stage.config.vocab_size, (2, stage.config.seq_len))
    stage.backward("m0", inputs, targets=targets)
    stage.grad_sums[0].fill_(float("inf"))  # as after a loss that overflowed
    stage.step()
    assert stage.steps_skipped == 1
    assert "skipped an optimizer step" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, stage.module.parameters()))
    stage.backward("m1", inputs, targets=targets)  # the next step is a normal one
    stage.step()
    assert stage.steps_skipped == 1
    assert all(torch.isfinite(p).all() for p in stage.module.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, stage.module.parameters()))
