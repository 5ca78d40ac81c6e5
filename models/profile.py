"""The workload estimator: measure each layer of a model on this device (FusionLLM's idea of
per-operator compute and transfer costs, at the granularity a pipeline can cut).

Each layer (embedding, every block, head + loss) is timed alone on one microbatch, forward then
backward with a random output gradient, `repeats` times after `warmup` runs; the median is kept.
Sizes are counted from the modules themselves. The result is a `ModelProfile` (models.layer_costs).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from models.config import GPTConfig
from models.gpt import language_model_loss
from models.layer_costs import LayerCost, LayerKind, ModelProfile
from models.stages import build_full_model

__all__ = ["profile_model", "device_name"]

# Optimizer state bytes per parameter byte (fp32 state): AdamW keeps two moments, SGD none.
OPTIMIZER_STATE_FACTOR = {"adamw": 2, "sgd": 0}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(run_forward: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float, torch.Tensor]:
    """Forward and backward seconds of one run of `run_forward` (which builds a fresh graph)."""
    _synchronize(device)
    started = time.perf_counter()
    with torch.enable_grad():
        output = run_forward()
    _synchronize(device)
    forward_s = time.perf_counter() - started
    grad = None if output.dim() == 0 else torch.randn_like(output)
    started = time.perf_counter()
    torch.autograd.backward(output, grad)
    _synchronize(device)
    return forward_s, time.perf_counter() - started, output.detach()


def _sizes(module: nn.Module, optimizer: str) -> dict[str, int]:
    parameters = sum(p.numel() for p in module.parameters())
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return dict(
        parameters=parameters,
        parameter_bytes=parameter_bytes,
        gradient_bytes=parameter_bytes,
        optimizer_bytes=OPTIMIZER_STATE_FACTOR[optimizer] * parameter_bytes,
    )


def profile_model(
    config: GPTConfig,
    *,
    batch_size: int = 4,
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    optimizer: str = "adamw",
    seed: int = 0,
) -> ModelProfile:
    """Measure every layer of `config` on `device` with microbatches of `batch_size` samples."""
    if batch_size < 1 or repeats < 1 or warmup < 0:
        raise ValueError("batch_size and repeats must be at least 1, warmup at least 0")
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(f"unknown optimizer {optimizer!r}; use {' or '.join(OPTIMIZER_STATE_FACTOR)}")
    target = torch.device(device)
    model = build_full_model(config, seed).to(target)
    generator = torch.Generator().manual_seed(seed)
    B, T, C, V = batch_size, config.seq_len, config.d_model, config.vocab_size
    tokens = torch.randint(0, V, (B, T), generator=generator).to(target)  # (B, T)
    targets = torch.randint(0, V, (B, T), generator=generator).to(target)  # (B, T)
    hidden = torch.randn(B, T, C, generator=generator).to(target)  # (B, T, C)

    def leaf() -> torch.Tensor:
        return hidden.detach().requires_grad_(True)  # a fresh input whose gradient is computed, as on a peer

    chain: list[tuple[str, LayerKind, nn.Module, Callable[[], torch.Tensor]]] = [
        ("embedding", LayerKind.EMBEDDING, model.embedding, lambda: model.embedding(tokens))
    ]
    for index, block in enumerate(model.blocks):
        chain.append((f"block.{index}", LayerKind.BLOCK, block, lambda block=block: block(leaf())))
    chain.append(("head", LayerKind.HEAD, model.head, lambda: language_model_loss(model.head(leaf()), targets)))

    # Rounds over the whole chain, so that a burst of load from elsewhere on the machine hits
    # every layer alike instead of inflating whichever layer was being timed.
    forward_s: list[list[float]] = [[] for _ in chain]
    backward_s: list[list[float]] = [[] for _ in chain]
    outputs: list[torch.Tensor | None] = [None for _ in chain]
    for round_index in range(warmup + repeats):
        for position, (_, _, module, run_forward) in enumerate(chain):
            f, b, outputs[position] = _time_once(run_forward, target)
            module.zero_grad(set_to_none=True)
            if round_index >= warmup:
                forward_s[position].append(f)
                backward_s[position].append(b)
    layers = [
        LayerCost(
            name=name,
            kind=kind,
            forward_s=statistics.median(forward_s[i]),
            backward_s=statistics.median(backward_s[i]),
            output_bytes=outputs[i].numel() * outputs[i].element_size(),
            **_sizes(module, optimizer),
        )
        for i, (name, kind, module, _) in enumerate(chain)
    ]
    return ModelProfile(
        model=config.name,
        n_layers=config.n_layers,
        d_model=C,
        seq_len=T,
        batch_size=B,
        device=str(target),
        device_name=device_name(target),
        num_threads=torch.get_num_threads(),
        repeats=repeats,
        optimizer=optimizer,
        torch_version=torch.__version__,
        layers=tuple(layers),
    )
