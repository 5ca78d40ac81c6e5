"""The model interface every architecture follows, built-in or the user's own (`--model module:function`).

A model is a chain of three kinds of parts, which the pipeline cuts between blocks:

    embedding   tokens (B, T) int64        -> hidden states (B, T, C) float32   first stage only
    block i     hidden states (B, T, C)    -> hidden states (B, T, C)           blocks 0..n_layers-1, any stage
    head        hidden states (B, T, C)    -> logits (B, T, vocab_size)         last stage only

The last stage adds the loss (models/gpt.py `language_model_loss`), so a head returns logits. T is
`seq_len` and C is `d_model`; `vocab_size` bounds the token ids. Your own architecture: a function
without arguments that returns `ModelParts` (sizes and a factory per part), named as
`--model package.module:function` and importable on every peer.

Each factory builds its part under its own seeded random state, so a stage built alone holds the
weights of the same slice of the whole model; factories must draw random numbers from torch's
default generator only. The fingerprint peers announce (models/identity.py) hashes the defining
module's source (`definition_hash`); code it imports is not covered.

An example, and what the memory check estimates rather than measures: docs/design/models.md.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn


class UserModelError(ValueError):
    """A `--model module:function` that cannot be used; the message says why, in one line."""


@dataclass(frozen=True)
class ModelParts:
    """What a model-building function returns (see the module docstring)."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    embedding: Callable[[], nn.Module]  # tokens (B, T) int64 -> (B, T, C)
    block: Callable[[int], nn.Module]  # block index -> module (B, T, C) -> (B, T, C)
    head: Callable[[], nn.Module]  # (B, T, C) -> logits (B, T, vocab_size)


def is_user_model(name: str) -> bool:
    """`package.module:function` names a user architecture; plain names are built-in configs."""
    return ":" in name


def _split(reference: str) -> tuple[str, str]:
    module_name, _, function_name = reference.partition(":")
    if not module_name or not function_name:
        raise UserModelError(f"--model {reference!r}: write a user architecture as package.module:function")
    return module_name, function_name


def _import(reference: str):
    module_name, function_name = _split(reference)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the working directory, as `python -m` does
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure to import is the user's to fix, in one line
        raise UserModelError(f"--model {reference!r}: module {module_name!r} does not import: {e}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserModelError(f"--model {reference!r}: module {module_name!r} has no function {function_name!r}")
    return module, function


def load_model_parts(reference: str) -> ModelParts:
    """Call the user's function; raises UserModelError when it fails or returns something else."""
    _, function = _import(reference)
    try:
        parts = function()
    except Exception as e:  # noqa: BLE001
        raise UserModelError(f"--model {reference!r}: calling it failed: {type(e).__name__}: {e}") from None
    if not isinstance(parts, ModelParts):
        raise UserModelError(
            f"--model {reference!r} returned {type(parts).__name__}, not models.interface.ModelParts "
            "(an embedding, a block factory and a head; see models/interface.py)"
        )
    sizes = dict(vocab_size=parts.vocab_size, seq_len=parts.seq_len, d_model=parts.d_model, n_layers=parts.n_layers)
    bad = [k for k, v in sizes.items() if not isinstance(v, int) or v <= 0]
    if bad:
        raise UserModelError(f"--model {reference!r}: {', '.join(bad)} must be positive integers")
    return parts


def definition_hash(reference: str) -> str:
    """sha256 of the source of the module that defines the function, normalised (line endings,
    trailing whitespace), so that the same file hashes alike on every peer."""
    module, _ = _import(reference)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError) as e:
        raise UserModelError(f"--model {reference!r}: cannot read the module's source to hash it: {e}") from None
    normalised = "\n".join(line.rstrip() for line in source.replace("\r\n", "\n").splitlines()).strip()
    return hashlib.sha256(normalised.encode()).hexdigest()[:32]


def seeded_generator_state(seed: int, component: int) -> int:
    """The seed of one part's random state: component 0 is the embedding, 1 the head, 2 + i block i."""
    return seed * 1_000_003 + component


def build_part(factory: Callable[[], nn.Module], seed: int, component: int) -> nn.Module:
    """`factory()` under its own seeded default generator (the caller's random state is kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeded_generator_state(seed, component))
        return factory()


def check_parts(reference: str, parts: ModelParts) -> tuple[int, int, int]:
    """Build each kind of part and run it on a (1, T) probe: raises UserModelError for a part that
    is not a module or maps the wrong shapes. Returns the parameter counts (embedding, block 0, head)."""
    T, C, V = parts.seq_len, parts.d_model, parts.vocab_size
    probes = (
        ("embedding", parts.embedding, torch.zeros(1, T, dtype=torch.int64), (1, T, C)),
        ("block 0", lambda: parts.block(0), torch.zeros(1, T, C), (1, T, C)),
        ("head", parts.head, torch.zeros(1, T, C), (1, T, V)),
    )
    counts = []
    for name, factory, probe, expected in probes:
        try:
            module = build_part(factory, 0, 0)
        except Exception as e:  # noqa: BLE001
            raise UserModelError(
                f"--model {reference!r}: building the {name} failed: {type(e).__name__}: {e}"
            ) from None
        if not isinstance(module, nn.Module):
            raise UserModelError(f"--model {reference!r}: the {name} is a {type(module).__name__}, not a torch module")
        try:
            with torch.no_grad():
                out = module(probe)
        except Exception as e:  # noqa: BLE001
            raise UserModelError(
                f"--model {reference!r}: the {name} fails on input {tuple(probe.shape)}: {type(e).__name__}: {e}"
            ) from None
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise UserModelError(
                f"--model {reference!r}: the {name} maps {tuple(probe.shape)} to {got}, the interface needs {expected}"
            )
        counts.append(sum(p.numel() for p in module.parameters()))
    return counts[0], counts[1], counts[2]
