"""--device, --precision and --optimizer adamw8bit, on the CPU (no GPU in CI)."""

from __future__ import annotations

import pytest
import torch

from models.config import get_model_config
from peers.compute.devices import DeviceError, build_optimizer, peak_memory_bytes, resolve_device
from peers.compute.stage_runtime import LossScale, OptimizerSettings, StageRuntime


def test_auto_falls_back_to_the_cpu_without_a_gpu():
    assert resolve_device("auto", cuda_count=0) == torch.device("cpu")
    assert resolve_device("auto", cuda_count=2) == torch.device("cuda:0")
    assert resolve_device("cuda:1", cuda_count=2) == torch.device("cuda:1")
    assert resolve_device("CPU", cuda_count=2) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")  # what this machine's torch reports


@pytest.mark.parametrize(
    "requested, message",
    [
        ("cuda", "torch sees no CUDA GPU"),
        ("cuda:0", "torch sees no CUDA GPU"),
        ("tpu", "use auto"),
        ("cuda:x", "use auto"),
    ],
)
def test_impossible_devices_are_refused_in_one_line(requested, message):
    with pytest.raises(DeviceError, match=message) as error:
        resolve_device(requested, cuda_count=0)
    assert "\n" not in str(error.value)
    with pytest.raises(DeviceError, match="has 2 CUDA GPU"):
        resolve_device("cuda:2", cuda_count=2)


def batch(config, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (n, config.seq_len), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def two_stage_grads(precision: str, optimizer: str = "sgd", name: str = "tiny"):
    config = get_model_config(name)
    settings = OptimizerSettings(optimizer=optimizer, lr=0.1, target_batch_size=1000)
    stages = [StageRuntime(config, s, 2, optimizer=settings, precision=precision) for s in range(2)]
    tokens, targets = batch(config)
    hidden = stages[0].forward("mb", tokens)
    grad, loss = stages[1].backward("mb", hidden, targets=targets)
    stages[0].backward("mb", tokens, grad_outputs=grad)
    return stages, hidden, grad, loss


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_reduced_precision_keeps_fp32_weights_and_fp32_wire_tensors(precision, name):
    ref_stages, ref_hidden, ref_grad, ref_loss = two_stage_grads("fp32", name=name)
    stages, hidden, grad, loss = two_stage_grads(precision, name=name)
    # What leaves a stage is float32 on the CPU whatever it computed in, so codecs and the next
    # stage's checks see the same contract.
    assert hidden.dtype == grad.dtype == torch.float32 and hidden.device.type == "cpu"
    assert not torch.equal(hidden, ref_hidden)  # it really computed in reduced precision
    tolerance = 0.05 if precision == "bf16" else 0.01
    assert torch.linalg.norm(hidden - ref_hidden) / torch.linalg.norm(ref_hidden) < tolerance
    assert abs(loss - ref_loss) / ref_loss < tolerance
    for stage, ref in zip(stages, ref_stages):
        assert all(p.dtype == torch.float32 for p in stage.module.parameters())  # master weights
        for got, want in zip(stage.grad_sums, ref.grad_sums):
            assert torch.linalg.norm(got - want) <= 0.1 * torch.linalg.norm(want) + 1e-8


def test_fp16_overflow_halves_the_loss_scale_and_still_returns_finite_gradients():
    config = get_model_config("tiny")
    settings = OptimizerSettings(optimizer="sgd", target_batch_size=1000)
    ref = StageRuntime(config, 1, 2, optimizer=settings)
    stage = StageRuntime(config, 1, 2, optimizer=settings, precision="fp16")
    stage.loss_scale.value = 2.0**40  # scaled gradients overflow float16 (max 65504)
    hidden = torch.randn(2, config.seq_len, config.d_model)
    _, targets = batch(config, n=2)
    grad, _ = stage.backward("a", hidden, targets=targets)
    ref_grad, _ = ref.backward("a", hidden, targets=targets)
    assert stage.loss_scale.value < 2.0**40
    assert torch.isfinite(grad).all()
    assert torch.linalg.norm(grad - ref_grad) < 0.02 * torch.linalg.norm(ref_grad)


def test_loss_scale_grows_back_after_a_run_of_good_steps():
    scale = LossScale(4.0, growth_interval=2)
    assert scale.overflowed() and scale.value == 2.0
    scale.succeeded(), scale.succeeded()
    assert scale.value == 4.0
    assert not LossScale(1.0).overflowed()  # at 1 an inf is the model's own


def test_adamw8bit_trains_on_the_cpu_and_its_state_travels():
    config = get_model_config("tiny")  # its MLP weights (4096 values) are just big enough for 8-bit moments
    settings = OptimizerSettings(optimizer="adamw8bit", lr=3e-2, target_batch_size=2)
    runtime = StageRuntime(config, 1, 2, optimizer=settings)
    assert type(runtime.optimizer).__name__ == "AdamW8bit"
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, config.seq_len, config.d_model, generator=g)
    _, targets = batch(config, n=2)
    losses = []
    for step in range(3):
        _, loss = runtime.backward(f"mb{step}", hidden, targets=targets)
        losses.append(loss)
    assert runtime.steps_done == 3 and losses[-1] < losses[0]
    states = [s for s in runtime.optimizer.state.values() if "state1" in s]
    assert states and any(s["state1"].dtype == torch.uint8 for s in states)  # 8-bit moments really used
    copy = StageRuntime(config, 1, 2, optimizer=settings)
    from peers.compute.checkpoint import deserialize_state

    copy.import_state(deserialize_state(runtime.export_state("tiny")), "tiny", "test")
    _, a = runtime.backward("next", hidden, targets=targets)
    _, b = copy.backward("next", hidden, targets=targets)
    assert a == b


def test_unknown_optimizer_is_a_clear_error():
    with pytest.raises(DeviceError, match="adamw8bit"):
        build_optimizer(
            "lion",
            [torch.nn.Parameter(torch.zeros(2))],
            lr=1e-3,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            device=torch.device("cpu"),
        )


def test_a_cpu_peer_reports_no_gpu_memory():
    assert peak_memory_bytes(torch.device("cpu")) == 0.0
