"""The start-up memory model: checked against what autograd really saves, and the refusals."""

from __future__ import annotations

import pytest
import torch

from models.config import GPTConfig, get_model_config
from models.stages import build_stage, split_layers
from peers.compute import devices
from peers.compute.memory_budget import (
    GiB,
    MemoryBudgetError,
    activation_bytes,
    available_memory_bytes,
    blocks_per_stage_to_num_stages,
    check_fits,
    estimate_stage_memory,
    fewest_stages_that_fit,
    stage_parameters,
)
from peers.compute.stage_runtime import StageRuntime


def saved_tensor_bytes(config: GPTConfig, stage: int, num_stages: int, batch: int, precision: str) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward."""
    module = build_stage(config, stage, num_stages)
    params = {p.data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if stage == 0:
        x = torch.randint(0, config.vocab_size, (batch, config.seq_len))
    else:
        x = torch.randn(batch, config.seq_len, config.d_model, requires_grad=True)
    y = torch.randint(0, config.vocab_size, (batch, config.seq_len)) if stage == num_stages - 1 else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), devices.autocast(torch.device("cpu"), precision):
        module(x, y)
    return sum(storages.values())


SHAPES = [
    GPTConfig(name="g", vocab_size=512, seq_len=32, n_layers=4, d_model=64, n_heads=4),
    GPTConfig(name="g2", vocab_size=300, seq_len=48, n_layers=4, d_model=96, n_heads=6, mlp_ratio=2),
    GPTConfig(name="l", arch="llama", vocab_size=512, seq_len=32, n_layers=4, d_model=64, n_heads=4),
    GPTConfig(name="l2", arch="llama", vocab_size=300, seq_len=48, n_layers=4, d_model=128, n_heads=8, mlp_hidden=200),
]


@pytest.mark.parametrize("config", SHAPES, ids=lambda c: c.name)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_estimate_is_close_to_what_autograd_saves(config, precision):
    for stage in range(3):
        measured = saved_tensor_bytes(config, stage, 3, batch=2, precision=precision)
        estimated = activation_bytes(config, split_layers(config.n_layers, 3)[stage], 2, precision)
        assert 0.8 <= estimated / measured <= 1.3, (stage, estimated, measured)


def test_parameter_count_per_stage_adds_up():
    for name in ("tiny", "llama-tiny", "gpt2-124m", "llama-1b"):
        config = get_model_config(name)
        specs = split_layers(config.n_layers, 3)
        assert sum(stage_parameters(config, s) for s in specs) == config.num_parameters()


def test_optimizer_and_batch_change_the_estimate():
    config = get_model_config("gpt2-124m")
    spec = split_layers(config.n_layers, 2)[0]
    adamw = estimate_stage_memory(config, spec, optimizer="adamw", batch_size=1)
    eight_bit = estimate_stage_memory(config, spec, optimizer="adamw8bit", batch_size=1)
    assert adamw.optimizer_bytes == 8 * adamw.parameters
    assert 2 * adamw.parameters <= eight_bit.optimizer_bytes < 2.01 * adamw.parameters
    assert estimate_stage_memory(config, spec, batch_size=8).working_bytes == 8 * adamw.working_bytes


def test_a_model_too_big_for_the_limit_is_refused_in_one_line():
    config = get_model_config("llama-1b")
    spec = split_layers(config.n_layers, 2)[0]
    estimate = estimate_stage_memory(config, spec, optimizer="adamw", batch_size=1)
    with pytest.raises(MemoryBudgetError) as error:
        check_fits(estimate, 2 * GiB, what="llama-1b stage 0/2", source="--memory-limit-gb")
    message = str(error.value)
    assert "\n" not in message and "does not fit" in message and "2.00 GiB" in message
    assert "serve fewer layers" in message  # the weights alone are too big: a smaller batch would not help
    check_fits(estimate, estimate.total_bytes, what="x", source="y")  # exactly enough is enough
    small = get_model_config("small")
    big_batch = estimate_stage_memory(small, split_layers(6, 2)[0], batch_size=4096)
    with pytest.raises(MemoryBudgetError, match="lower --max-batch-size"):
        check_fits(big_batch, big_batch.total_bytes - big_batch.working_bytes + 1, what="small", source="z")


def test_num_layers_auto_picks_the_fewest_stages_that_fit():
    config = get_model_config("gpt2-124m")
    kwargs = dict(optimizer="adamw", precision="fp32", batch_size=1)
    whole = estimate_stage_memory(config, split_layers(config.n_layers, 1)[0], **kwargs).total_bytes
    assert fewest_stages_that_fit(config, 0, whole, **kwargs) == 1
    tighter = fewest_stages_that_fit(config, 0, whole // 2, **kwargs)
    assert 2 <= tighter < config.n_layers
    chosen = split_layers(config.n_layers, tighter)[0]
    assert estimate_stage_memory(config, chosen, **kwargs).total_bytes <= whole // 2
    assert fewest_stages_that_fit(config, 5, whole, **kwargs) == 6  # stage 5 needs at least 6 stages
    with pytest.raises(MemoryBudgetError, match="single block"):
        fewest_stages_that_fit(config, 0, GiB // 4, **kwargs)
    assert blocks_per_stage_to_num_stages(12, 5) == 3 and blocks_per_stage_to_num_stages(12, 50) == 1


def test_available_memory_is_known_here():
    assert available_memory_bytes(torch.device("cpu")) > 64 * 2**20


def test_the_activation_cache_stays_within_its_byte_budget():
    config = get_model_config("tiny")
    entry = activation_bytes(config, split_layers(config.n_layers, 2)[1], 2)
    runtime = StageRuntime(config, 1, 2, cache_budget_bytes=int(2.5 * entry))
    for i in range(5):
        runtime.forward(
            f"mb{i}",
            torch.randn(2, config.seq_len, config.d_model),
            torch.randint(0, config.vocab_size, (2, config.seq_len)),
        )
    assert list(runtime.cache) == ["mb3", "mb4"]  # two microbatches of 2 samples fit, the oldest went


def test_num_layers_sets_the_number_of_stages_when_the_peer_starts_a_swarm(capsys):
    from peers.config import ComputeSettings, PeerConfig
    from peers.settle import _split_by_layers as _resolve_num_layers

    config = get_model_config("gpt2-124m")
    fixed = _resolve_num_layers(
        PeerConfig(model="gpt2-124m", stage=0, num_layers="5"), config, torch.device("cpu"), 64 * GiB
    )
    assert fixed.num_stages == 3  # 12 blocks, at most 5 per stage
    budget = estimate_stage_memory(config, split_layers(12, 4)[1], batch_size=1).total_bytes
    auto = _resolve_num_layers(
        PeerConfig(model="gpt2-124m", stage=1, num_layers="auto", compute=ComputeSettings(max_batch_size=1)),
        config,
        torch.device("cpu"),
        budget,
    )
    assert (
        auto.num_stages
        == fewest_stages_that_fit(config, 1, budget, optimizer="adamw", precision="fp32", batch_size=1)
        <= 4
    )
    assert "--num-layers auto: gpt2-124m split into" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "tests.integration.test_user_model:mixer"])
def test_adapters_are_counted_as_add_adapters_makes_them(name):
    pytest.importorskip("peft")
    import dataclasses

    from models.lora import add_adapters

    config = dataclasses.replace(get_model_config(name), trainable="lora:4")
    if name == "llama-tiny":  # grouped-query attention: k and v narrower than q
        config = dataclasses.replace(config, n_kv_heads=2)
    for spec in split_layers(config.n_layers, 2):
        stage = build_stage(config, spec.index, 2)
        made = add_adapters(stage, 4, first_layer=spec.first_layer)
        estimate = estimate_stage_memory(config, spec, optimizer="adamw")
        assert estimate.trainable == made
        assert estimate.parameters == sum(p.numel() for p in stage.parameters())


def test_with_adapters_only_they_have_gradients_and_optimizer_state():
    """A peer fine-tuning adapters is not refused for the AdamW moments and gradients of frozen
    weights: those count only the adapters, the frozen base only its weights."""
    import dataclasses

    full = get_model_config("gpt2-124m")
    lora = dataclasses.replace(full, trainable="lora:8")
    spec = split_layers(full.n_layers, 2)[0]
    everything = estimate_stage_memory(full, spec, optimizer="adamw")
    adapters = estimate_stage_memory(lora, spec, optimizer="adamw")
    added = adapters.parameters - everything.parameters
    assert added == 6 * 8 * (8 * 768 + 2 * 3072)  # 6 blocks: qkv (d+3d), proj (2d), up and down (d+h) of rank 8
    assert adapters.trainable == added and everything.trainable == everything.parameters
    assert adapters.parameter_bytes == 4 * adapters.parameters
    assert adapters.gradient_bytes == 2 * 4 * added and adapters.optimizer_bytes == 8 * added
    assert "trainable" in adapters.describe() and "trainable" not in everything.describe()
    # memory enough for the adapters' run but not for full training: only full training is refused
    room = adapters.total_bytes
    check_fits(adapters, room, what="lora", source="--memory-limit-gb")
    with pytest.raises(MemoryBudgetError, match="does not fit"):
        check_fits(everything, room, what="all", source="--memory-limit-gb")
