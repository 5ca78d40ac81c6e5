"""User architectures (`--model module:function`, models/interface.py): resolution, refusal of bad
input in one line, per-part seeded weights, and a definition hash that follows the source."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from models.config import get_model_config
from models.identity import model_fingerprint
from models.interface import UserModelError
from models.model_source import VocabularyError, resolve_model
from models.profile import profile_model
from models.stages import build_full_model, build_stage

ARCH = """
import torch
import torch.nn as nn

from models.interface import ModelParts


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 12)

    def forward(self, tokens):
        return self.table(tokens)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.value = nn.Linear(12, 12), nn.Linear(12, 12)

    def forward(self, x):
        return x + torch.sigmoid(self.gate(x)) * self.value(x)


def build():
    return ModelParts(vocab_size=64, seq_len=8, d_model=12, n_layers=4,
                      embedding=Tokens, block=lambda i: Gated(), head=lambda: nn.Linear(12, 64))


def wrong_type():
    return (Tokens(), [Gated()], nn.Linear(12, 64))


def wrong_head():
    return ModelParts(vocab_size=64, seq_len=8, d_model=12, n_layers=4,
                      embedding=Tokens, block=lambda i: Gated(), head=lambda: nn.Linear(12, 10))
"""


@pytest.fixture
def arch_module(tmp_path, monkeypatch):
    """Write the architecture as module `user_arch_<n>` on sys.path; returns a function that writes
    it again (optionally changed) under a new module name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(extra: str = "") -> str:
        name = f"user_arch_{len(written)}_{abs(hash(str(tmp_path))) % 10**6}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(ARCH) + extra)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_a_stage_built_alone_holds_the_slice_of_the_whole_model(arch_module):
    config = get_model_config(f"{arch_module()}:build")
    assert (config.arch, config.n_layers, config.d_model, config.seq_len, config.vocab_size) == ("user", 4, 12, 8, 64)
    whole = dict(build_full_model(config, seed=3).named_parameters())
    stage = build_stage(config, 1, 2, seed=3, boundaries=(0, 1, 4))
    for name, value in stage.named_parameters():
        if name.startswith("blocks."):
            index = int(name.split(".")[1]) + 1
            name = f"blocks.{index}." + name.split(".", 2)[2]
        assert torch.equal(value, whole[name]), name
    assert not torch.equal(whole["blocks.0.gate.weight"], whole["blocks.1.gate.weight"])  # each part its own seed
    # The parameter counts the memory check and the planner use are the parts' own.
    assert config.num_parameters() == sum(p.numel() for p in whole.values())


def test_the_workload_estimator_measures_every_part(arch_module):
    config = get_model_config(f"{arch_module()}:build")
    profile = profile_model(config, batch_size=2, repeats=1, warmup=0)
    assert [layer.name for layer in profile.layers] == ["embedding", "block.0", "block.1", "block.2", "block.3", "head"]
    assert profile.layers[1].output_bytes == 2 * 8 * 12 * 4


def test_the_fingerprint_follows_the_definition(arch_module):
    same_a, same_b = get_model_config(arch_module() + ":build"), get_model_config(arch_module() + ":build")
    changed = get_model_config(arch_module("\nEXTRA = 1\n") + ":build")
    trailing_spaces = get_model_config(arch_module("   ") + ":build")
    assert same_a.code_hash == same_b.code_hash == trailing_spaces.code_hash  # normalised
    assert changed.code_hash != same_a.code_hash
    assert model_fingerprint(changed) != model_fingerprint(same_a)


@pytest.mark.parametrize(
    "function, message",
    [
        ("no_such_module_here:build", "does not import"),
        ("{module}:missing", "has no function 'missing'"),
        ("{module}:wrong_type", "returned tuple, not models.interface.ModelParts"),
        ("{module}:wrong_head", "the head maps (1, 8, 12) to (1, 8, 10), the interface needs (1, 8, 64)"),
        ("{module}:", "package.module:function"),
    ],
)
def test_bad_input_is_refused_in_one_line(arch_module, function, message):
    with pytest.raises(UserModelError) as error:
        get_model_config(function.format(module=arch_module()))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_vocabulary_other_than_the_parts_is_refused_in_one_line(arch_module):
    name = arch_module() + ":build"
    assert resolve_model(name, vocab_size=64).vocab_size == 64
    with pytest.raises(VocabularyError, match="has a vocabulary of 64 tokens, not 4096"):
        resolve_model(name, vocab_size=4096)
