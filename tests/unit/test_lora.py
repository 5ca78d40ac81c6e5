"""LoRA adapters (`--trainable lora:R`, models/lora.py): frozen base, seeded adapters, a split step
equal to one process's, adapter-only state, and merged weights equal to base + scale * B @ A."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.config import get_model_config, lora_rank
from models.lora import adapters_only, add_adapters, base_weights, merge_adapters, trainable_state_dict
from models.stages import build_full_model, build_stage
from peers.compute.checkpoint import deserialize_state
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime

pytest.importorskip("peft")

RANK = 4


def adapted(config, stage=None, num_stages=1, seed=0):
    module = build_full_model(config, seed) if stage is None else build_stage(config, stage, num_stages, seed)
    add_adapters(module, RANK, seed=seed, first_layer=module.spec.first_layer)
    return module


def test_only_adapters_train_and_the_adapted_model_starts_as_the_base():
    config = get_model_config("tiny")
    base, model = build_full_model(config), adapted(config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(n.startswith("blocks.") for n in trainable)  # embedding and head stay frozen
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    torch.testing.assert_close(model(tokens, tokens), base(tokens, tokens), atol=0, rtol=0)  # B starts at zero


def test_a_stage_built_alone_gets_the_adapters_of_the_same_slice():
    config = get_model_config("tiny")
    whole = dict(adapted(config).named_parameters())
    stage = adapted(config, stage=1, num_stages=2)
    first = stage.spec.first_layer
    for name, value in stage.named_parameters():
        if name.startswith("blocks."):
            name = f"blocks.{int(name.split('.')[1]) + first}." + name.split(".", 2)[2]
        assert torch.equal(value, whole[name]), name


def test_a_split_adapter_step_equals_one_process():
    config = get_model_config("tiny")
    lora = replace(config, trainable=f"lora:{RANK}")
    settings = OptimizerSettings(optimizer="sgd", lr=0.5, target_batch_size=4)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)
    # One process: the whole adapted model, one SGD step on the adapters.
    reference = adapted(config)
    optimizer = settings.build([p for p in reference.parameters() if p.requires_grad])
    reference(tokens, targets).backward()
    optimizer.step()
    # Two stages, each with its own adapters, the same step through the runtime.
    stages = [StageRuntime(lora, s, 2, optimizer=settings) for s in range(2)]
    counts = [runtime.use_adapters() for runtime in stages]
    assert sum(counts) == sum(p.numel() for p in reference.parameters() if p.requires_grad)
    hidden = stages[0].forward("mb", tokens)
    grad, _ = stages[1].backward("mb", hidden, targets=targets)
    stages[0].backward("mb", tokens, grad_outputs=grad)
    assert [runtime.steps_done for runtime in stages] == [1, 1]
    expected = dict(reference.named_parameters())
    for runtime in stages:
        first = runtime.module.spec.first_layer
        state = trainable_state_dict(runtime.module)
        assert state and all(".lora_" in name for name in state)  # a checkpoint holds only the adapters
        for name, value in state.items():
            name = f"blocks.{int(name.split('.')[1]) + first}." + name.split(".", 2)[2]
            torch.testing.assert_close(value, expected[name].detach(), atol=1e-6, rtol=0)
        assert any(".lora_B." in n and v.abs().sum() > 0 for n, v in state.items())  # the step moved B


def test_adapter_state_round_trips_through_export_and_import():
    config = get_model_config("tiny")
    lora = replace(config, trainable="lora:2")
    source, target = StageRuntime(lora, 0, 2, seed=0), StageRuntime(lora, 0, 2, seed=0)
    source.use_adapters(), target.use_adapters()
    with torch.no_grad():
        for name, value in trainable_state_dict(source.module).items():
            value.add_(0.25)
    target.import_state(deserialize_state(source.export_state("tiny")), "tiny", "test")
    for name, value in trainable_state_dict(target.module).items():
        assert torch.equal(value, trainable_state_dict(source.module)[name])


def test_merged_weights_equal_base_plus_scaled_b_times_a():
    config = get_model_config("tiny")
    model = adapted(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # trained adapters: B no longer zero
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    state = model.state_dict()
    base, adapters = base_weights(state), adapters_only(state)
    merged = merge_adapters(base, adapters, scale=1.0)
    a = adapters["blocks.0.attn.qkv.lora_A.default.weight"]
    b = adapters["blocks.0.attn.qkv.lora_B.default.weight"]
    torch.testing.assert_close(merged["blocks.0.attn.qkv.weight"], base["blocks.0.attn.qkv.weight"] + b @ a)
    torch.testing.assert_close(merged["embedding.tok.weight"], base["embedding.tok.weight"], atol=0, rtol=0)
    # The merged weights in a plain model compute what the adapted model computes.
    plain = build_full_model(config)
    plain.load_state_dict(merged)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=generator)
    torch.testing.assert_close(plain(tokens, tokens), model(tokens, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("text, rank", [("all", None), ("lora:8", 8), ("lora:1", 1)])
def test_trainable_modes_parse(text, rank):
    assert lora_rank(text) == rank


@pytest.mark.parametrize("text", ["lora", "lora:0", "lora:x", "adapters:8", "ALL"])
def test_bad_trainable_modes_are_refused_in_one_line(text):
    with pytest.raises(ValueError, match="use all or lora:R"):
        lora_rank(text)
