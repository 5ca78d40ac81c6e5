"""What a stage needs in memory, and whether it fits: checked at start-up, before anything is built.

Pure functions over a `GPTConfig` and a `StageSpec`, except `available_memory_bytes`, which reads
the machine (/proc/meminfo and the cgroup limit on the CPU, `torch.cuda.mem_get_info` on a GPU).

The model of a stage's memory:
* parameters: float32 master weights (also under bf16/fp16 autocast);
* gradients: the float32 accumulators (`StageRuntime.grad_sums`) plus the gradients of the
  microbatch being computed, so two float32 copies of the trainable parameters;
* optimizer state: AdamW two float32 moments (8 B/parameter), 8-bit AdamW two uint8 moments plus
  one float32 scale per 2048-value block (~2 B/parameter), SGD none; of the trainable parameters
  alone. With `--trainable lora:R` those are the adapters (models/lora.py), whose weights add to
  the frozen base's; with `all`, every parameter;
* activations: what autograd saves for backward, per token and per block, calibrated against
  `torch.autograd.graph.saved_tensors_hooks` on the CPU (tests/unit/test_memory_budget.py keeps
  the estimate within 0.8-1.3x of the measured bytes, fp32 and bf16, GPT and LLaMA blocks);
  under autocast each forward also keeps 16-bit copies of the weight matrices; the working set of
  one microbatch of `max_batch_size` samples adds the transient gradient buffers of the backward.
  Not checked on a GPU (none was available), where attention kernels may save other tensors.
The activation cache is not in the check: it is an optimisation (a miss recomputes), and the
runtime bounds it to the bytes left over (`cache_budget_bytes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from models.config import GPTConfig, lora_rank
from models.lora import adapter_parameters_per_block
from models.stages import StageSpec
from process.config import ConfigError

GiB = 2**30
OPTIMIZER_BYTES_PER_PARAMETER = {"sgd": 0.0, "adamw": 8.0, "adamw8bit": 2.0 + 4.0 / 2048}
# What a peer process needs besides its stage: torch, hivemind, the DHT node and p2pd (~330 MB
# measured, see DATA.md) plus room for request buffers.
PROCESS_OVERHEAD_BYTES = 512 * 2**20


class MemoryBudgetError(ConfigError):
    """The stage does not fit in the memory available; the message says what would."""


def stage_parameters(config: GPTConfig, spec: StageSpec) -> int:
    return (
        (config.embedding_parameters() if spec.is_first else 0)
        + len(spec.layers) * config.block_parameters()
        + (config.head_parameters() if spec.is_last else 0)
    )


def adapter_parameters(config: GPTConfig, spec: StageSpec) -> int:
    """The LoRA adapters `--trainable lora:R` adds to the stage's blocks (0 with `all`)."""
    rank = lora_rank(config.trainable)
    return 0 if rank is None else len(spec.layers) * adapter_parameters_per_block(config, rank)


def _saved_per_token(config: GPTConfig, spec: StageSpec, precision: str) -> int:
    """Bytes autograd saves per token of one sample. Fitted on the CPU with
    saved_tensors_hooks: a GPT block keeps ~8d + 2h + 2 n_heads float32 values per token (LayerNorm
    inputs, q/k/v, attention output, residuals, the MLP hidden before and after GELU), a LLaMA
    block ~14d + 4h (RMSNorm and rotary keep float32 copies; SwiGLU keeps gate, up and their
    product). Under bf16/fp16 autocast most of them are kept in 16 bits."""
    d, h, heads = config.d_model, config.hidden_size, config.n_heads
    fp32 = precision == "fp32"
    if config.arch == "llama":
        per_block = 4 * (14 * d + 4 * h + 2 * heads) if fp32 else 4 * (6 * d + 2 * heads) + 2 * (8 * d + 4 * h)
    else:
        per_block = 4 * (8 * d + 2 * h + 2 * heads) if fp32 else 4 * (2 * d + 2 * heads) + 2 * (6 * d + 2 * h)
    per_token = len(spec.layers) * per_block
    if spec.is_first:
        per_token += 16  # token ids
    if spec.is_last:
        per_token += 4 * (config.vocab_size + 3 * d + 1)  # final norm and the float32 log-softmax of the logits
    return per_token


def _autocast_weight_copies(config: GPTConfig, spec: StageSpec, precision: str) -> int:
    """Under bf16/fp16 autocast each forward keeps its own 16-bit copies of the weight matrices."""
    if precision == "fp32":
        return 0
    d, h = config.d_model, config.hidden_size
    matrices = 4 * d * d + (3 if config.arch == "llama" else 2) * d * h
    return 2 * (len(spec.layers) * matrices + (d * config.vocab_size if spec.is_last else 0))


def activation_bytes(config: GPTConfig, spec: StageSpec, batch_size: int, precision: str = "fp32") -> int:
    """Bytes autograd keeps for the backward of one forward of `batch_size` samples (what one
    entry of the activation cache holds)."""
    return batch_size * config.seq_len * _saved_per_token(config, spec, precision) + _autocast_weight_copies(
        config, spec, precision
    )


def working_bytes(config: GPTConfig, spec: StageSpec, batch_size: int, precision: str = "fp32") -> int:
    """Peak of one microbatch in flight: what is saved, plus the transient buffers of its backward
    (gradients of the widest activations; the logits and their gradient on the last stage)."""
    transient = 4 * 2 * max(config.hidden_size, config.d_model)
    if spec.is_last:
        transient += 4 * 2 * config.vocab_size
    return activation_bytes(config, spec, batch_size, precision) + batch_size * config.seq_len * transient


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # count, adapters included
    trainable: int  # what has gradients and optimizer state: every parameter, or only the adapters
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    working_bytes: int  # one microbatch of `batch_size` samples in flight
    overhead_bytes: int
    batch_size: int

    @property
    def total_bytes(self) -> int:
        return (
            self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.working_bytes + self.overhead_bytes
        )

    def describe(self) -> str:
        trainable = "" if self.trainable == self.parameters else f" of {self.trainable / 1e6:.2f}M trainable"
        return (
            f"{self.total_bytes / GiB:.2f} GiB = weights {self.parameter_bytes / GiB:.2f} + gradients{trainable} "
            f"{self.gradient_bytes / GiB:.2f} + optimizer {self.optimizer_bytes / GiB:.2f} + activations of "
            f"{self.batch_size} samples {self.working_bytes / GiB:.2f} + process {self.overhead_bytes / GiB:.2f}"
        )


def estimate_stage_memory(
    config: GPTConfig,
    spec: StageSpec,
    *,
    optimizer: str = "adamw",
    precision: str = "fp32",
    batch_size: int = 1,
    device_type: str = "cpu",
) -> MemoryEstimate:
    """What serving `spec` needs with microbatches of up to `batch_size` samples."""
    if optimizer not in OPTIMIZER_BYTES_PER_PARAMETER:
        raise MemoryBudgetError(f"no memory model for optimizer {optimizer!r}")
    adapters = adapter_parameters(config, spec)
    n = stage_parameters(config, spec) + adapters
    trainable = n if lora_rank(config.trainable) is None else adapters  # adapters: the base is frozen
    return MemoryEstimate(
        parameters=n,
        trainable=trainable,
        parameter_bytes=4 * n,
        gradient_bytes=2 * 4 * trainable,
        optimizer_bytes=int(OPTIMIZER_BYTES_PER_PARAMETER[optimizer] * trainable),
        working_bytes=working_bytes(config, spec, batch_size, precision),
        overhead_bytes=PROCESS_OVERHEAD_BYTES if device_type == "cpu" else 0,
        batch_size=batch_size,
    )


def check_fits(estimate: MemoryEstimate, available_bytes: int, *, what: str, source: str) -> None:
    """Raise a one-line `MemoryBudgetError` when `estimate` exceeds `available_bytes`."""
    if estimate.total_bytes <= available_bytes:
        return
    static = estimate.total_bytes - estimate.working_bytes
    hint = (
        "lower --max-batch-size"
        if static <= available_bytes
        else "serve fewer layers (more --num-stages, or --num-layers auto), use --optimizer adamw8bit or sgd, "
        "or a machine with more memory"
    )
    raise MemoryBudgetError(
        f"{what} does not fit: it needs about {estimate.describe()}, but {source} is "
        f"{available_bytes / GiB:.2f} GiB; {hint}"
    )


def cache_budget_bytes(estimate: MemoryEstimate, available_bytes: int) -> int:
    """What the activation cache may use: what the check leaves over, with a 20% margin."""
    return max(int(0.8 * (available_bytes - estimate.total_bytes)), 0)


def fewest_stages_that_fit(
    config: GPTConfig,
    stage: int,
    available_bytes: int,
    *,
    optimizer: str,
    precision: str,
    batch_size: int,
    device_type: str = "cpu",
) -> int:
    """`--num-layers auto`: the fewest stages of the equal split (so the most blocks per stage)
    for which stage `stage` fits in `available_bytes`. Raises MemoryBudgetError if even one
    block per stage does not fit."""
    from models.stages import split_layers

    estimate = None
    for num_stages in range(stage + 1, config.n_layers + 1):
        spec = split_layers(config.n_layers, num_stages)[stage]
        estimate = estimate_stage_memory(
            config, spec, optimizer=optimizer, precision=precision, batch_size=batch_size, device_type=device_type
        )
        if estimate.total_bytes <= available_bytes:
            return num_stages
    if estimate is None:
        raise MemoryBudgetError(f"--stage {stage} is beyond the {config.n_layers} blocks of {config.name}")
    check_fits(
        estimate,
        available_bytes,
        what=f"{config.name} stage {stage} with a single block",
        source="the memory available",
    )
    raise AssertionError("unreachable")


def blocks_per_stage_to_num_stages(n_layers: int, blocks_per_stage: int) -> int:
    """`--num-layers N`: the equal split whose stages hold at most N blocks."""
    if blocks_per_stage < 1:
        raise MemoryBudgetError(f"--num-layers must be at least 1 (or auto), got {blocks_per_stage}")
    return -(-n_layers // min(blocks_per_stage, n_layers))


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on `device`: the GPU's free memory, or on the CPU the smaller of the kernel's
    MemAvailable and what this process's cgroup may still use."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    candidates.extend(_cgroup_room())
    if not candidates:
        raise MemoryBudgetError("cannot tell how much memory is available here; pass --memory-limit-gb")
    return min(candidates)


def _cgroup_room() -> list[int]:
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if path is None:
            return []
        folder = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return []
        with open(os.path.join(folder, "memory.current")) as f:
            current = int(f.read().strip())
        return [max(int(limit) - current, 0)]
    except (OSError, ValueError, IndexError):
        return []
