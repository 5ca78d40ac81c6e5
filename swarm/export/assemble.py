"""Stages to one model, without I/O: pick each stage's most-trained replica, check that the stages
fit together (one split covering every block, one vocabulary, one step), and rename each stage's
local tensors to the whole model's names (`models.init_weights.global_name`).

The split is read from the tensors themselves (how many blocks each stage holds) and compared
with the split the swarm or the checkpoint file names, so a stage of another split is refused
whatever its file or record says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence

import torch

from models.config import GPTConfig
from models.init_weights import global_name
from models.stages import build_full_model
from peers.replicas.outer_averaging import agreed_state

EMBEDDING_WEIGHT = "embedding.tok.weight"
HEAD_WEIGHT = "head.out.weight"
# Replicas that average agree up to the all-reduce's rounding; beyond this they are different copies.
AGREEMENT_ATOL = 1e-5
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


class ExportError(ValueError):
    """The stages cannot be assembled into one model; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class StagePart:
    """One replica's copy of one stage: its local tensors and where they came from."""

    stage: int
    num_stages: int
    steps_done: int
    state: dict[str, torch.Tensor]
    source: str  # "replica …abcd1234" or a checkpoint path

    @property
    def num_blocks(self) -> int:
        indices = {int(m.group(1)) for name in self.state if (m := _BLOCK.match(name))}
        return max(indices) + 1 if indices else 0


@dataclasses.dataclass(frozen=True)
class ReplicaChoice:
    part: StagePart
    disagreement: str | None  # one line when the replicas of the stage differ, else None


def agreed_part(module_state: dict, optimizer_state: dict, source: str) -> tuple[dict, str]:
    """A replica's tensors as the export takes them: an outer-rounds replica's anchors (what its
    stage's replicas agree on at their last round, which the source then names), else its own."""
    agreed = agreed_state(module_state, optimizer_state)
    if agreed is None:
        return module_state, source
    state, rounds = agreed
    return state, f"{source} (the anchor of its outer rounds, after {rounds})"


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two stages' tensors (inf when their names or shapes differ)."""
    if set(a) != set(b):
        return float("inf")
    worst = 0.0
    for name, tensor in a.items():
        other = b[name]
        if tensor.shape != other.shape:
            return float("inf")
        if tensor.numel():
            worst = max(worst, (tensor.float() - other.float()).abs().max().item())
    return worst


def content_digest(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def choose_replica(parts: Sequence[StagePart]) -> ReplicaChoice:
    """The most-trained replica of one stage; says so when the others differ by more than rounding."""
    if not parts:
        raise ValueError("choose_replica needs at least one replica")
    # Among equally trained replicas, a choice by content: the same replicas read live or from their
    # checkpoints give the same export, whatever order they come in.
    best = min(parts, key=lambda p: (-p.steps_done, content_digest(p.state)))
    others = [p for p in parts if p is not best]
    differing = [(p, max_difference(best.state, p.state)) for p in others]
    differing = [(p, diff) for p, diff in differing if diff > AGREEMENT_ATOL or p.steps_done != best.steps_done]
    if not differing:
        return ReplicaChoice(best, None)
    described = ", ".join(f"{p.source}: {p.steps_done} steps, max |difference| {diff:.3g}" for p, diff in differing)
    return ReplicaChoice(
        best,
        f"stage {best.stage}: its replicas disagree ({described}); exporting the most-trained one, "
        f"{best.source} ({best.steps_done} steps)",
    )


def check_stages_fit(
    config: GPTConfig,
    parts: dict[int, StagePart],
    *,
    boundaries: Sequence[int] | None = None,
    steps_must_match: bool = True,
) -> GPTConfig:
    """Check that `parts` (one per stage) make one model of `config`'s architecture; returns the
    config with the vocabulary the tensors hold. `boundaries`: the split the swarm or the checkpoint
    files name (default: whatever the tensors describe must still cover every block).
    `steps_must_match=False` when some stage's replicas do not average: each then steps on its own
    share of the samples, so stages with different numbers of replicas reach different steps."""
    if not parts:
        raise ExportError("no stage to export")
    num_stages = {p.num_stages for p in parts.values()}
    if len(num_stages) != 1:
        described = ", ".join(f"stage {s} of {p.num_stages} ({p.source})" for s, p in sorted(parts.items()))
        raise ExportError(f"the stages come from different splits: {described}")
    (n,) = num_stages
    missing = [s for s in range(n) if s not in parts]
    if missing:
        raise ExportError(f"stage(s) {', '.join(map(str, missing))} of {n} missing: every stage is needed")
    found = [0]
    for s in range(n):
        found.append(found[-1] + parts[s].num_blocks)
    if found[-1] != config.n_layers or any(b >= a for b, a in zip(found, found[1:])):
        raise ExportError(
            f"the stages hold blocks at boundaries {','.join(map(str, found))}, which is no split of "
            f"{config.name}'s {config.n_layers} blocks: are they stages of another model?"
        )
    if boundaries is not None and tuple(boundaries) != tuple(found):
        raise ExportError(
            f"the stages' tensors describe the split {','.join(map(str, found))}, not the swarm's "
            f"{','.join(map(str, boundaries))}"
        )
    first, last = parts[0], parts[n - 1]
    if config.arch == "user":  # its own tensor names, its vocabulary from its function: checked by shape
        if steps_must_match and not same_step(parts):
            raise ExportError(
                f"the stages are at different steps ({describe_steps(parts)}); export when training has paused"
            )
        _check_shapes(config, assemble_state(parts, boundaries=found), found)
        return config
    if EMBEDDING_WEIGHT not in first.state or HEAD_WEIGHT not in last.state:
        raise ExportError(
            f"stage 0 has no {EMBEDDING_WEIGHT} or stage {n - 1} no {HEAD_WEIGHT}: not a {config.arch} model"
        )
    vocab, head_vocab = first.state[EMBEDDING_WEIGHT].shape[0], last.state[HEAD_WEIGHT].shape[0]
    if vocab != head_vocab:
        raise ExportError(f"stage 0 has a vocabulary of {vocab} tokens, stage {n - 1} one of {head_vocab}")
    if steps_must_match and not same_step(parts):
        raise ExportError(
            f"the stages are at different steps ({describe_steps(parts)}); export when training has paused"
        )
    config = dataclasses.replace(config, vocab_size=int(vocab))
    _check_shapes(config, assemble_state(parts, boundaries=found), found)
    return config


def same_step(parts: dict[int, StagePart]) -> bool:
    return len({p.steps_done for p in parts.values()}) == 1


def describe_steps(parts: dict[int, StagePart]) -> str:
    return ", ".join(f"stage {s}: {p.steps_done}" for s, p in sorted(parts.items()))


def assemble_state(parts: dict[int, StagePart], *, boundaries: Sequence[int]) -> dict[str, torch.Tensor]:
    """The whole model's state dict (names of `build_full_model`) from one part per stage."""
    state = {}
    for s, part in sorted(parts.items()):
        for name, tensor in part.state.items():
            state[global_name(name, boundaries[s])] = tensor
    return state


def block_boundaries(parts: dict[int, StagePart]) -> tuple[int, ...]:
    bounds = [0]
    for s in sorted(parts):
        bounds.append(bounds[-1] + parts[s].num_blocks)
    return tuple(bounds)


def _check_shapes(config: GPTConfig, state: dict[str, torch.Tensor], boundaries: Sequence[int]) -> None:
    with torch.device("meta"):  # shapes only: nothing is allocated, whatever the model's size
        model = build_full_model(config, boundaries=boundaries)  # a learned subspace has parts at the boundaries
        wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if set(state) != set(wanted):
        missing, extra = sorted(set(wanted) - set(state))[:3], sorted(set(state) - set(wanted))[:3]
        raise ExportError(
            f"the stages are not a whole {config.name} model (missing {missing}, unexpected {extra}): "
            "are they stages of another model?"
        )
    for name, shape in wanted.items():
        if tuple(state[name].shape) != shape:
            raise ExportError(
                f"{name} has shape {tuple(state[name].shape)}, {config.name} needs {shape}: "
                "are the stages of another model?"
            )
