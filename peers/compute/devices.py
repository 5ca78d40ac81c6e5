"""Where a peer computes and in which precision: `--device`, `--precision`, `--optimizer adamw8bit`.

Master weights and optimizer state stay float32 whatever the precision: bf16/fp16 only change the
dtype of the matmuls, through `torch.autocast`. What crosses the wire does not depend on any of
this: a stage hands on float32 CPU tensors and the codec chooses the wire format (see
`StageRuntime`).
"""

from __future__ import annotations

import contextlib
import re

import torch

from process.config import ConfigError

DEVICE_CHOICES_HELP = "auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:N"
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ("adamw", "sgd", "adamw8bit")


class DeviceError(ConfigError):
    """A device, precision or optimizer this machine cannot provide; the message says what to use instead."""


def resolve_device(requested: str, *, cuda_count: int | None = None) -> torch.device:
    """`auto` -> cuda:0 when torch sees a GPU, else cpu; `cuda[:N]` must exist. `cuda_count`
    overrides what torch reports (for tests)."""
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    text = requested.strip().lower()
    if text == "auto":
        return torch.device("cuda:0") if count > 0 else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if not match:
        raise DeviceError(f"--device {requested!r}: use {DEVICE_CHOICES_HELP}")
    index = int(match.group(1) or 0)
    if count == 0:
        raise DeviceError(
            f"--device {requested}: torch sees no CUDA GPU on this machine (torch {torch.__version__}"
            f"{', a CPU-only build' if torch.version.cuda is None else ''}); use --device cpu or auto"
        )
    if index >= count:
        raise DeviceError(f"--device {requested}: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
    return torch.device(f"cuda:{index}")


def describe_device(device: torch.device) -> str:
    """One line for the start-up log: which device, and what it is."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    return f"cpu ({torch.get_num_threads()} compute thread(s))"


def peak_memory_bytes(device: torch.device) -> float:
    """The most memory this process's tensors took on `device` so far (a GPU: torch's allocator's
    peak); 0 on the CPU, whose memory the process's resident size already shows."""
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0


PRECISION_CHOICES = ("auto", *PRECISIONS)


def resolve_precision(requested: str, device: torch.device) -> str:
    """`auto` -> bf16 on a CUDA GPU that has it (autocast; weights and optimizer stay fp32), else fp32."""
    if requested != "auto":
        return requested
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def check_precision(device: torch.device, precision: str) -> None:
    if precision not in PRECISIONS:
        raise DeviceError(f"--precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support; use fp16")


def autocast(device: torch.device, precision: str):
    """The context the stage computes in: autocast to bf16/fp16, or nothing for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_optimizer(
    kind: str, params, *, lr: float, betas: tuple[float, float], weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """adamw/sgd from torch, adamw8bit from bitsandbytes (8-bit blockwise moments; tensors under
    4096 values keep 32-bit moments)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "adamw8bit":
        return _adamw8bit_class(device)(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise DeviceError(f"unknown optimizer {kind!r}; use one of {', '.join(OPTIMIZERS)}")


def check_optimizer(kind: str, device: torch.device) -> None:
    """Refuse, in one line, an optimizer this machine cannot run (before anything is started)."""
    if kind not in OPTIMIZERS:
        raise DeviceError(f"unknown optimizer {kind!r}; use one of {', '.join(OPTIMIZERS)}")
    if kind == "adamw8bit":
        _adamw8bit_class(device)


def _adamw8bit_class(device: torch.device):
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise DeviceError(
            f"--optimizer adamw8bit needs bitsandbytes, which cannot be imported here ({e}); use --optimizer adamw"
        ) from None
    if device.type == "cpu" and not _bnb_has_cpu_optimizer(bnb):
        raise DeviceError(
            f"--optimizer adamw8bit: bitsandbytes {bnb.__version__} has no 8-bit optimizer for "
            f"the CPU (0.50 or newer has); use --optimizer adamw or a GPU"
        )
    return bnb.optim.AdamW8bit


def _bnb_has_cpu_optimizer(bnb) -> bool:
    """One 8-bit step on a small CPU tensor: the only reliable test across bitsandbytes versions."""
    try:
        param = torch.nn.Parameter(torch.zeros(4096))
        optimizer = bnb.optim.AdamW8bit([param], lr=1e-3)
        param.grad = torch.ones_like(param)
        optimizer.step()
        return bool(torch.isfinite(param).all())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False
