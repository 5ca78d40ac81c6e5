"""Where a peer's configuration is settled: the run's spec plus the peer's own flags, once, at start-up.

`PeerConfig` only validates what the user wrote. `settle` reads what that needs (the model's config,
the initial weights' hash) and returns the effective configuration: every option the spec fixes
(peers/run_spec.py `spec_options`) takes the spec's value; a flag the user set that contradicts it
is refused (`SpecConflictError`, one line naming both values); the device's precision is chosen.
With no spec to join (the first peer of a swarm with no owner), the peer's own settings become the
spec. A spec the peer cannot satisfy (a model folder or weights file it lacks, a model that differs)
is refused in one line. Memory is checked by the launcher on the stage it picks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from dht.model_match import ModelMismatchError
from dht.run_specs import SpecError
from models.balanced_split import BalancedSplitError, memory_balanced_boundaries
from models.config import GPTConfig
from models.identity import model_fingerprint
from models.model_source import resolve_model
from models.stages import equal_boundaries, split_from_boundaries, stage_spec
from peers.compute import memory_budget
from peers.compute.devices import resolve_precision
from peers.config import AUTO_STAGE, MEMORY_SPLIT, PeerConfig
from peers.run_spec import RunSpec, file_sha256, spec_of_peer, spec_options
from process.config import ConfigError, option_values, replace_options


class SpecConflictError(SpecError):
    """A flag the user set says otherwise than the run's spec."""


@dataclass(frozen=True)
class SettledPeer:
    config: PeerConfig  # the effective configuration: the spec's settings and this peer's own
    model: GPTConfig  # the model it serves (vocabulary, trainable mode and subspace included)
    spec: RunSpec
    made_here: bool  # the spec is this peer's own: the first peer of a swarm with no owner

    @property
    def boundaries(self) -> tuple[int, ...]:
        return self.spec.split.boundaries

    def describe(self) -> str:
        """The start-up lines: what the run says, then what this peer brings."""
        config = self.config
        memory = f"{config.compute.memory_limit_gb:g} GiB" if config.compute.memory_limit_gb else "what is free"
        local = (
            f"  this peer: stage {config.stage}, precision {config.compute.precision}, "
            f"memory {memory}, checkpoints {config.checkpointing.checkpoint_dir or 'off'}"
        )
        return f"{self.spec.describe()}\n{local}"


def settle(
    config: PeerConfig,
    given: Collection[str],
    spec: RunSpec | None,
    *,
    device: torch.device,
    available_bytes: int,
    created_at: float,
) -> SettledPeer:
    """The effective configuration of a peer with `config`, whose user set the options `given`,
    joining the run of `spec` (None: no run to join, so this peer's settings start one)."""
    given = set(given)
    precision = resolve_precision(config.compute.precision, device)
    if spec is None:
        if not given & {"model", "model_dir"}:
            raise SpecError(
                "no run to join on this DHT: its owner publishes one (`swarm run create --initial-peers ...`), "
                "or name the model (--model / --model-dir) to start a swarm with this peer's settings"
            )
        model = _own_model(config)
        config = _split_by_layers(config, model, device, available_bytes)
        boundaries = _own_boundaries(config, model)
        init_sha = _init_weights_sha256(config.init_weights)
        spec = spec_of_peer(config, model, boundaries, created_at=created_at, init_weights_sha256=init_sha)
        made_here = True
    else:
        _refuse_contradictions(config, given, spec)
        model = _spec_model(config, spec)
        _check_init_weights(config, spec)
        made_here = False
    effective = replace_options(
        config,
        **spec_options(spec),
        split_boundaries=",".join(map(str, spec.split.boundaries)),
        num_layers=None,
        precision=precision,
    )
    if effective.stage != AUTO_STAGE:  # StageSplitError (one line) for a stage the split does not have
        stage_spec(model, effective.stage, spec.split.num_stages, spec.split.boundaries)
    return SettledPeer(effective, model, spec, made_here)


# --- a spec of this peer's own ---------------------------------------------------------------------


def _own_model(config: PeerConfig) -> GPTConfig:
    model = resolve_model(config.model, config.model_dir, config.vocab_size)
    return config.subspace.apply(dataclasses.replace(model, trainable=config.trainable))


def _split_by_layers(config: PeerConfig, model: GPTConfig, device: torch.device, available: int) -> PeerConfig:
    """--num-layers N|auto sets --num-stages (the equal split with at most N blocks per stage)."""
    if config.num_layers is None:
        return config
    if config.num_layers == "auto":
        num_stages = memory_budget.fewest_stages_that_fit(
            model,
            0 if config.stage == AUTO_STAGE else config.stage,
            available,
            optimizer=config.optim.optimizer,
            precision=resolve_precision(config.compute.precision, device),
            batch_size=config.compute.max_batch_size,
            device_type=device.type,
        )
    else:
        num_stages = memory_budget.blocks_per_stage_to_num_stages(model.n_layers, int(config.num_layers))
    print(
        f"--num-layers {config.num_layers}: {config.model} split into {num_stages} stage(s) of at most "
        f"{-(-model.n_layers // num_stages)} block(s)",
        flush=True,
    )
    return dataclasses.replace(config, num_stages=num_stages)


def _own_boundaries(config: PeerConfig, model: GPTConfig) -> tuple[int, ...]:
    """The split this peer asks for: --split-boundaries (numbers, or `memory`), else the equal split."""
    if config.split_boundaries is not None and config.split_boundaries.strip() == MEMORY_SPLIT:
        try:
            return memory_balanced_boundaries(
                block_parameters=model.block_parameters(),
                n_layers=model.n_layers,
                embedding_parameters=model.embedding_parameters(),
                head_parameters=model.head_parameters(),
                num_stages=config.num_stages,
            )
        except BalancedSplitError as e:
            raise ConfigError(f"--split-boundaries memory: {e}") from None
    requested = config.requested_boundaries
    if requested is None:
        split_from_boundaries(model.n_layers, equal_boundaries(model.n_layers, config.num_stages))
        return equal_boundaries(model.n_layers, config.num_stages)
    if len(requested) != config.num_stages + 1:
        stage_spec(model, 0, config.num_stages, requested)  # StageSplitError naming the mismatch
    split_from_boundaries(model.n_layers, requested)  # StageSplitError for boundaries the model lacks
    return tuple(requested)


def _init_weights_sha256(path: str | None) -> str:
    if path is None:
        return ""
    if not os.path.isfile(path):
        raise ConfigError(f"--init-weights {path!r}: no such file")
    return file_sha256(path)


# --- a spec from the run -----------------------------------------------------------------------------


def _refuse_contradictions(config: PeerConfig, given: set[str], spec: RunSpec) -> None:
    mine, theirs = option_values(config), spec_options(spec)
    conflicts = [(name, mine[name], theirs[name]) for name in sorted(given & set(theirs)) if mine[name] != theirs[name]]
    if "model_dir" in given and spec.source.kind != "folder":
        conflicts.append(("model_dir", config.model_dir, f"the {spec.source.kind} model {spec.model}"))
    if {"split_boundaries", "num_layers"} & given:
        asked = _asked_split(config, spec)
        if asked != spec.split.boundaries:
            name = "split_boundaries" if "split_boundaries" in given else "num_layers"
            conflicts.append((name, getattr(config, name), ",".join(map(str, spec.split.boundaries))))
    if conflicts:
        listed = ", ".join(f"--{n.replace('_', '-')} {_text(m)} (the run's: {_text(t)})" for n, m, t in conflicts)
        raise SpecConflictError(
            f"this peer's flags contradict the spec of run {spec.run_id!r} (version {spec.version}): {listed}; "
            f"leave {'it' if len(conflicts) == 1 else 'them'} out to take the run's"
        )


def _asked_split(config: PeerConfig, spec: RunSpec) -> tuple[int, ...] | None:
    model = spec.model_config_resolved
    if config.num_layers is not None:
        if config.num_layers == "auto":
            return None  # the run's split is fixed: a split chosen by this machine's memory is another
        num_stages = memory_budget.blocks_per_stage_to_num_stages(model.n_layers, int(config.num_layers))
        return equal_boundaries(model.n_layers, num_stages)
    asked = dataclasses.replace(config, num_stages=spec.split.num_stages)
    try:
        return _own_boundaries(asked, model)
    except (ConfigError, ValueError):
        return None


def _text(value: Any) -> str:
    return "none" if value is None else str(value)


def _spec_model(config: PeerConfig, spec: RunSpec) -> GPTConfig:
    """The run's model as this peer can build it; refused in one line when it cannot (no folder, a
    module that does not import) or when what it builds differs from the run's (another fingerprint)."""
    if spec.source.kind == "folder" and config.model_dir is None:
        raise SpecError(
            f"run {spec.run_id!r} trains the Hugging Face folder model {spec.model!r} (fingerprint "
            f"{spec.source.fingerprint}): start this peer with --model-dir DIR, the folder with its weights"
        )
    if spec.source.kind == "named" and config.model_dir is not None:
        raise SpecError(f"run {spec.run_id!r} trains the named model {spec.model}; leave out --model-dir")
    return check_own_model(spec, config.model_dir, who="peer")


def check_own_model(spec: RunSpec, model_dir: str | None, *, who: str) -> GPTConfig:
    """The run's model, checked against this machine's copy where it has one (a folder's config, a
    user architecture's code): ModelMismatchError (one line) when that copy is another model."""
    wanted = spec.model_config_resolved
    kind = spec.source.kind
    if kind == "named" or (kind == "folder" and model_dir is None):
        return wanted
    built = resolve_model(spec.model, model_dir) if kind == "folder" else resolve_model(spec.model)
    built = dataclasses.replace(
        built,
        name=wanted.name,
        vocab_size=wanted.vocab_size,
        trainable=wanted.trainable,
        subspace_rank=wanted.subspace_rank,
        subspace_kind=wanted.subspace_kind,
    )
    mine = model_fingerprint(built)
    if mine != spec.source.fingerprint:
        where = f"the folder {model_dir}" if kind == "folder" else f"this {who}'s code of {spec.model}"
        raise ModelMismatchError(
            f"{where} is another model: its fingerprint {mine} differs from the one run {spec.run_id!r} trains "
            f"({spec.source.fingerprint}); every peer and trainer needs the same "
            f"{'folder contents' if kind == 'folder' else 'code'}"
        )
    return built


def _check_init_weights(config: PeerConfig, spec: RunSpec) -> None:
    wanted = spec.source.init_weights_sha256
    if not wanted:
        if config.init_weights is not None:
            raise SpecConflictError(
                f"--init-weights {config.init_weights}: run {spec.run_id!r} starts from the seed "
                f"{spec.source.seed}, not from a weights file; leave it out"
            )
        return
    if config.init_weights is None:
        raise SpecError(
            f"run {spec.run_id!r} starts from a weights file (sha256 {wanted}): give this peer --init-weights FILE"
        )
    mine = _init_weights_sha256(config.init_weights)
    if mine != wanted:
        raise SpecError(
            f"--init-weights {config.init_weights} (sha256 {mine}) is not the file run {spec.run_id!r} starts from "
            f"(sha256 {wanted})"
        )
