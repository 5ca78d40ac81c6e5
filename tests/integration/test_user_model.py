"""An architecture of the user's own, defined only here (a token-mixing MLP block, not the built-in
transformer blocks), trained through a 2-stage swarm: its update equals one process's, and a peer
or trainer whose definition under the same name differs is refused in one line.

The peers load it as `--model tests.integration.test_user_model:mixer` (models/interface.py).
This module imports only the project's packages, so that a changed copy of it can run apart.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn as nn

from models.interface import ModelParts

MODEL = "tests.integration.test_user_model:mixer"
REPO = pathlib.Path(__file__).resolve().parents[2]
VOCAB, SEQ, WIDTH, BLOCKS = 256, 16, 24, 4
BATCH, MICROBATCH = 8, 2


class TokenEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        return self.table(tokens)


class CausalMixerBlock(nn.Module):
    """x + tanh(channels(causal token mixing of norm(x))): mixing across positions through a
    lower-triangular (T, T) matrix, so that no position sees a later one."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Parameter(torch.randn(SEQ, SEQ) / SEQ)
        self.channels = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        T = x.shape[1]
        mixed = torch.tril(self.mix[:T, :T]) @ self.norm(x)  # (T, T) @ (B, T, C)
        return x + torch.tanh(self.channels(mixed))


class Readout(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.out(self.norm(x))


def mixer() -> ModelParts:
    return ModelParts(
        vocab_size=VOCAB,
        seq_len=SEQ,
        d_model=WIDTH,
        n_layers=BLOCKS,
        embedding=TokenEmbedding,
        block=lambda index: CausalMixerBlock(),
        head=Readout,
    )


def reference_update(config, lr: float):
    from models.stages import build_full_model
    from peers.compute.stage_runtime import OptimizerSettings
    from swarm.trainer.data import MicrobatchSampler, open_data

    sampler = MicrobatchSampler(
        open_data(None).train, seq_len=config.seq_len, batch_size=BATCH, microbatch_size=MICROBATCH
    )
    microbatches = sampler.batch(0)
    inputs = torch.cat([mb.inputs for mb in microbatches])
    targets = torch.cat([mb.targets for mb in microbatches])
    model = build_full_model(config)
    optimizer = OptimizerSettings(optimizer="sgd", lr=lr).build(model.parameters())
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    return loss.item(), dict(model.named_parameters())


def changed_copy(root: pathlib.Path) -> pathlib.Path:
    """This module under the same name, its blocks' update halved: another definition."""
    package = root / "tests" / "integration"
    package.mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    source = pathlib.Path(__file__).read_text().replace("return x + torch.tanh(", "return x + 0.5 * torch.tanh(")
    (package / "test_user_model.py").write_text(source)
    return root


@pytest.mark.slow
def test_a_user_architecture_trains_through_the_swarm_as_in_one_process(make_swarm, tmp_path):
    from models.config import get_model_config
    from models.stages import build_full_model, stage_spec
    from peers.compute.checkpoint import checkpoint_path, load_checkpoint

    config = get_model_config(MODEL)
    lr, ckpt = 0.5, str(tmp_path / "ckpt")
    swarm = make_swarm(
        model=MODEL,
        num_stages=2,
        peer_args=["--optimizer", "sgd", "--lr", str(lr), "--target-batch-size", str(BATCH), "--checkpoint-dir", ckpt],
    )
    swarm.start_bootstrap()
    peers = [swarm.start_peer(stage) for stage in range(2)]
    swarm.wait_online(peers)
    report_path = str(tmp_path / "report.json")
    common = ["--model", MODEL, "--steps", "1", "--batch-size", str(BATCH), "--microbatch-size", str(MICROBATCH)]
    trainer = swarm.start_trainer(*common[2:], "--num-stages", "2", "--report", report_path)
    assert trainer.popen.wait(timeout=180) == 0, trainer.log()

    # The same name, another definition: refused in one line, the peer and the trainer alike.
    elsewhere = ["env", "-C", str(changed_copy(tmp_path / "changed")), f"PYTHONPATH={REPO}"]
    intruder = swarm.start_peer(1, name="peer-intruder", prefix=elsewhere)
    assert intruder.popen.wait(timeout=120) != 0
    errors = [line for line in intruder.log().splitlines() if "error" in line]
    assert len(errors) == 1 and "differs from the one" in errors[0], intruder.log()
    other = swarm.start_trainer(*common[2:], "--num-stages", "2", name="trainer-other", prefix=elsewhere)
    assert other.popen.wait(timeout=120) != 0
    assert "differs from the one" in other.log() and "Traceback" not in other.log(), other.log()

    for peer in peers:  # a clean exit writes each stage's checkpoint
        peer.stop()
    with open(report_path) as f:
        report = json.load(f)
    ref_loss, ref_params = reference_update(config, lr)
    assert report["losses"][0] == pytest.approx(ref_loss, abs=1e-5)
    initial = dict(build_full_model(config).named_parameters())
    compared = 0
    for stage in range(2):
        meta, state, _ = load_checkpoint(checkpoint_path(ckpt, MODEL, stage, 2))
        assert meta.steps_done == 1
        offset = stage_spec(config, stage, 2).first_layer
        for name, value in state.items():
            if name.startswith("blocks."):
                name = f"blocks.{int(name.split('.')[1]) + offset}." + name.split(".", 2)[2]
            # SGD: the update is lr times the gradient, so equal updates are equal gradients.
            torch.testing.assert_close(value, ref_params[name].detach(), atol=1e-5, rtol=0)
            assert not torch.equal(value, initial[name].detach()), f"{name} did not change"
            compared += 1
    assert compared == len(ref_params)

    # export: no transformers class for it, so the trained state in the project's naming, said in one line
    from safetensors.torch import load_file

    from swarm.export.config import ExportConfig
    from swarm.export.run import run_export

    lines = []
    run_export(ExportConfig(model=MODEL, checkpoint_dir=[ckpt], out=str(tmp_path / "export")), say=lines.append)
    assert sum("transformers folder needs a known architecture" in line for line in lines) == 1, lines
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) == set(ref_params)
    for name, value in exported.items():
        torch.testing.assert_close(value, ref_params[name].detach(), atol=1e-5, rtol=0)
