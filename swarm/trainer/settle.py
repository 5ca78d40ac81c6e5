"""Where a trainer's configuration is settled: the run's spec plus its own flags, once, at start.

The spec (peers/run_spec.py) fixes the model (its config comes from the spec, so a trainer needs no
model folder), the number of stages, the codec when it names one, and the default batch (the spec's
target batch); a flag the user set that contradicts it is refused in one line naming both values.
The data's vocabulary must be the model's, and its tokenizer the spec's when the spec names one.
With no spec on the DHT (peers older than specs), the trainer's own flags say everything, as before.
While it trains, `follow_versions` picks up the run's later versions, whose number each commit names.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import hivemind

from dht.authority import RunInfo
from dht.model_match import VocabularyMismatchError
from dht.run_specs import SignedSpec, SpecError, fetch_runs, fetch_runs_async
from models.config import GPTConfig
from models.interface import UserModelError
from peers.run_spec import RunSpec, file_sha256, find_run_spec, parse_spec
from peers.settle import SpecConflictError, check_own_model
from process.config import option_values, replace_options
from swarm.trainer.config import TrainerConfig
from swarm.trainer.data import PreparedData, model_for_data

SPEC_REFRESH_S = 5.0  # how often a training trainer looks for a new version of the run's spec


@dataclass(frozen=True)
class SettledTrainer:
    config: TrainerConfig  # the effective configuration
    model: GPTConfig  # the model trained, with the data's vocabulary
    spec: RunSpec | None  # None: no spec on the DHT, the flags say everything
    signed: SignedSpec | None = None
    run: RunInfo | None = None  # the run's authority, from its spec (a private run, or a credential's)


def find_spec(dht: hivemind.DHT, config: TrainerConfig, given: Collection[str]) -> SignedSpec | None:
    """The signed spec of the run this trainer joins (`find_run_spec`, a peer's rule), or None."""
    model = config.model if "model" in given else None
    return find_run_spec(fetch_runs(dht), config.authority, model=model, initial_peers=config.network.initial_peers)


def settle_trainer(
    config: TrainerConfig, given: Collection[str], signed: SignedSpec | None, data: PreparedData
) -> SettledTrainer:
    given = set(given)
    if signed is None:
        model = model_for_data(config.model, config.model_dir, data)
        model = config.subspace.apply(dataclasses.replace(model, trainable=config.trainable))
        return SettledTrainer(replace_options(config, model=model.name), model, None)
    spec = parse_spec(signed)
    _refuse_contradictions(config, given, spec)
    model = spec.model_config_resolved
    if spec.source.kind != "named":  # this trainer's copy of the model, if it has one, is the run's
        try:
            check_own_model(spec, config.model_dir, who="trainer")
        except UserModelError:
            pass  # a trainer holds no weights: it needs no code of a user architecture
    # a named model's vocabulary is the data's; a model folder keeps its own, which the data's ids must fit
    fits = data.vocab_size <= model.vocab_size if spec.source.kind == "folder" else data.vocab_size == model.vocab_size
    if not fits:
        raise VocabularyMismatchError(
            f"the data in {data.folder} has a vocabulary of {data.vocab_size} tokens, but run {spec.run_id!r} "
            f"trains {spec.model} with {model.vocab_size}: prepare the data with the run's tokenizer"
        )
    wanted = spec.source.tokenizer_sha256
    if wanted and file_sha256(data.tokenizer_path) != wanted:
        raise SpecError(
            f"the data in {data.folder} was tokenized with another tokenizer (sha256 {file_sha256(data.tokenizer_path)}) "
            f"than run {spec.run_id!r}'s ({wanted}): prepare it with the run's (`swarm data prepare --tokenizer FILE`)"
        )
    values = _spec_options(spec)
    if "batch_size" not in given:
        values["batch_size"] = spec.optim.target_batch_size
    run = RunInfo(run_id=spec.run_id, owner_public_key=signed.signer_key, private=spec.private) if spec.owned else None
    return SettledTrainer(replace_options(config, **values), model, spec, signed, run)


def _spec_options(spec: RunSpec) -> dict[str, Any]:
    model = spec.model_config_resolved
    values: dict[str, Any] = {
        "model": spec.model,
        "trainable": model.trainable,
        "subspace_rank": model.subspace_rank,
        "subspace_kind": model.subspace_kind,
        "num_stages": spec.split.num_stages,
    }
    if spec.codec.codec is not None:
        values |= spec.codec.model_dump()
    return values


def _refuse_contradictions(config: TrainerConfig, given: set[str], spec: RunSpec) -> None:
    mine, theirs = option_values(config), _spec_options(spec)
    conflicts = [(name, mine[name], theirs[name]) for name in sorted(given & set(theirs)) if mine[name] != theirs[name]]
    if "model_dir" in given and spec.source.kind != "folder":
        conflicts.append(("model_dir", config.model_dir, f"the {spec.source.kind} model {spec.model}"))
    if conflicts:
        listed = ", ".join(f"--{n.replace('_', '-')} {m} (the run's: {t})" for n, m, t in conflicts)
        raise SpecConflictError(
            f"this trainer's flags contradict the spec of run {spec.run_id!r} (version {spec.version}): {listed}; "
            f"leave {'it' if len(conflicts) == 1 else 'them'} out to take the run's"
        )


async def follow_versions(
    dht: hivemind.DHT,
    settled: SettledTrainer,
    on_version: Callable[[RunSpec], None],
    stop: asyncio.Event,
    period_s: float = SPEC_REFRESH_S,
) -> None:
    """Every `period_s`, look for a later version of the run's spec (signed by the same key, only
    its schedule changed) and hand it to `on_version`."""
    spec, key = settled.spec, settled.signed.signer_key
    ignored: set[str] = set()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=period_s)
            return
        except TimeoutError:
            pass
        for run in await fetch_runs_async(dht) or ():
            if run.identity != (spec.run_id, key) or run.header.version <= spec.version or run.spec.digest in ignored:
                continue
            try:
                later = parse_spec(run.spec)
            except SpecError:
                later = None
            if later is None or not later.follows(spec):
                ignored.add(run.spec.digest)
                continue
            spec = later
            on_version(later)
