"""A run's spec: what every process of one run must agree on, as one typed record, signed.

    source    the model: its name and kind (a named config, a Hugging Face folder, a user
              architecture), its config and fingerprint, the seed of its initial weights (or the
              sha256 of --init-weights), the tokenizer's sha256
    split     the stages and their block boundaries
    optim     the optimizer, its settings, the learning-rate schedule and the target batch
    changes   later versions' learning-rate schedules, each from a stated step
    replicas  averaging: mode, schedule, codec, outer step, delay, robust reduction
    codec     what crosses between stages (the trainer's --codec; unset: the trainer's choice)

`optim` and `replicas` are the peer's own config sections (peers/config.py) as records, so an option
added there is carried here too (except `LOCAL_REPLICA_OPTIONS`). The owner writes a spec (`swarm run
create`: flags or TOML); a swarm with no owner takes its first peer's settings (`spec_of_peer`). A
later version changes only the learning-rate schedule, from a stated step (`with_change`).
`find_run_spec` is which spec a peer or trainer joins. peers/settle.py holds a peer to the spec;
dht/run_specs.py carries it on the DHT.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Collection, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dht.authority import RunAccessConfig, credential_run_id, load_run
from dht.run_specs import KnownRun, SignedSpec, SpecError, SpecHeader, run_in_force, vouching_peers
from models.config import GPTConfig
from models.identity import model_fingerprint
from peers.compute.lr_schedule import DECAYS, LearningRateSchedule, ScheduleHistory
from peers.compute.stage_runtime import OptimizerSettings
from peers.config import PeerConfig, ReplicaSettings
from process.config import record_model
from wire.compression.policy import CODEC_MODES

SPEC_FILE = "spec.json"  # the signed spec in the run's folder, its latest version
# Replica options each peer may tune for itself: they do not change what the replicas compute.
LOCAL_REPLICA_OPTIONS = frozenset({"load_state", "averaging_timeout_s", "averaging_matchmaking_s"})
SCHEDULE_OPTIONS = ("lr", "warmup_steps", "lr_decay", "lr_decay_steps", "lr_floor")
OptimSpec = record_model(OptimizerSettings, name="OptimSpec")
ReplicasSpec = record_model(ReplicaSettings, exclude=LOCAL_REPLICA_OPTIONS, name="ReplicasSpec")
ModelKind = Literal["named", "folder", "user"]

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSource(BaseModel):
    model_config = _STRICT

    kind: ModelKind  # named: a built-in config; folder: a Hugging Face folder each peer has; user: module:function
    config: dict[str, Any]  # models.config.GPTConfig's fields: sizes, vocabulary, trainable mode, subspace
    fingerprint: str = Field(min_length=1, max_length=64)  # models.identity.model_fingerprint of `config`
    seed: int = Field(ge=0)
    init_weights_sha256: str = Field(default="", max_length=64)  # '' = from the seed (or the folder)
    tokenizer_sha256: str = Field(default="", max_length=64)  # '' = not stated

    @model_validator(mode="after")
    def _fingerprint_is_the_configs(self) -> ModelSource:
        if model_fingerprint(self.gpt_config()) != self.fingerprint:
            raise ValueError(f"the fingerprint {self.fingerprint} is not that of the model's config")
        return self

    def gpt_config(self) -> GPTConfig:
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in self.config.items()}
        try:
            return GPTConfig(**values)
        except TypeError as e:
            raise ValueError(f"the model's config: {e}") from None


class SplitSpec(BaseModel):
    model_config = _STRICT

    num_stages: int = Field(ge=1, le=1024)
    boundaries: tuple[int, ...] = Field(min_length=2, max_length=1025)

    @model_validator(mode="after")
    def _boundaries_describe_the_stages(self) -> SplitSpec:
        b = self.boundaries
        if len(b) != self.num_stages + 1 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"boundaries {list(b)} do not describe {self.num_stages} non-empty stages")
        return self


class ScheduleChange(BaseModel):
    """A later version's learning-rate schedule, in force from `from_step` (the step count at which
    replicas take their next optimizer step) on."""

    model_config = _STRICT

    version: int = Field(ge=2)
    from_step: int = Field(ge=0)
    lr: float = Field(gt=0, allow_inf_nan=False)
    warmup_steps: int = Field(default=0, ge=0)
    lr_decay: Literal[DECAYS] = "constant"
    lr_decay_steps: int = Field(default=0, ge=0)
    lr_floor: float = 0.1

    @model_validator(mode="after")
    def _a_schedule(self) -> ScheduleChange:
        self.schedule()
        return self

    def schedule(self) -> LearningRateSchedule:
        return LearningRateSchedule(
            self.lr, self.warmup_steps, decay=self.lr_decay, decay_steps=self.lr_decay_steps, floor=self.lr_floor
        )

    def describe(self) -> str:
        decay = "" if self.lr_decay == "constant" else f", {self.lr_decay} decay over {self.lr_decay_steps} steps"
        return f"lr {self.lr:g} from step {self.from_step}{decay}"


class CodecSpec(BaseModel):
    model_config = _STRICT

    codec: Literal[tuple(CODEC_MODES)] | None = None  # None: each trainer's --codec
    topk_fraction: float = Field(default=0.1, gt=0, le=1)
    codec_loss_budget: float = Field(default=0.02, ge=0)


class RunSpec(SpecHeader):
    """One version of a run's spec (the header's fields come first: dht/run_specs.py reads them alone)."""

    model_config = _STRICT

    private: bool = False  # with an owner: every call to a peer needs a credential (dht/authority.py)
    source: ModelSource
    split: SplitSpec
    optim: OptimSpec
    changes: tuple[ScheduleChange, ...] = ()
    replicas: ReplicasSpec
    codec: CodecSpec = CodecSpec()

    @model_validator(mode="after")
    def _versions_and_split_agree(self) -> RunSpec:
        if self.version != len(self.changes) + 1 or [c.version for c in self.changes] != list(
            range(2, self.version + 1)
        ):
            raise ValueError(f"version {self.version} must carry the changes of versions 2..{self.version}")
        steps = [c.from_step for c in self.changes]
        if steps != sorted(set(steps)):
            raise ValueError(f"each version's change must take effect after the last one's, got steps {steps}")
        if self.split.boundaries[-1] != self.source.gpt_config().n_layers:
            raise ValueError(
                f"the split {list(self.split.boundaries)} does not cover the model's "
                f"{self.source.gpt_config().n_layers} blocks"
            )
        if not self.owned and self.private:
            raise ValueError("only a run with an owner can be private")
        return self

    @property
    def model_config_resolved(self) -> GPTConfig:
        return self.source.gpt_config()

    def schedule(self, version: int | None = None) -> ScheduleHistory:
        """The learning rate of every step, as of `version` (None: this one)."""
        changes = [c for c in self.changes if version is None or c.version <= version]
        return ScheduleHistory(self.optim.settings().schedule(), tuple((c.from_step, c.schedule()) for c in changes))

    def with_change(self, *, from_step: int, **schedule: Any) -> RunSpec:
        """The next version: the learning-rate schedule `schedule` (SCHEDULE_OPTIONS; those left out
        keep the current version's values) from `from_step` on. ValueError for a step not after the
        last change's, or an option that is not one of the schedule's."""
        unknown = set(schedule) - set(SCHEDULE_OPTIONS)
        if unknown:
            raise ValueError(
                f"a new version changes only the learning-rate schedule ({', '.join(SCHEDULE_OPTIONS)}), "
                f"not {', '.join(sorted(unknown))}"
            )
        if self.changes and from_step <= self.changes[-1].from_step:
            raise ValueError(
                f"version {self.version} takes effect at step {self.changes[-1].from_step}; a new version must "
                f"take effect after it, not at step {from_step}"
            )
        current = self.changes[-1] if self.changes else self.optim
        values = {name: getattr(current, name) for name in SCHEDULE_OPTIONS} | schedule
        change = ScheduleChange(version=self.version + 1, from_step=from_step, **values)
        return self.model_copy(update={"version": change.version, "changes": (*self.changes, change)})

    def follows(self, earlier: RunSpec) -> bool:
        """Whether this is a later version of `earlier`: the same run, changes appended, all else equal."""
        same = self.model_dump(exclude={"version", "changes"}) == earlier.model_dump(exclude={"version", "changes"})
        return same and self.version >= earlier.version and self.changes[: len(earlier.changes)] == earlier.changes

    def describe(self) -> str:
        """A few lines for the start-up log: what the run trains and how."""
        model, optim, replicas = self.model_config_resolved, self.optim, self.replicas
        whose = "signed by its owner" if self.owned else "a swarm with no owner: its first peer's settings"
        source = {"named": "", "folder": ", a Hugging Face folder", "user": ", a user architecture"}[self.source.kind]
        extras = [f"trainable {model.trainable}"] if model.trainable != "all" else []
        if model.subspace_rank:
            extras.append(f"subspace {model.subspace_kind}:{model.subspace_rank}")
        schedule = f"lr {optim.lr:g}"
        if optim.warmup_steps:
            schedule += f", warmup {optim.warmup_steps} steps"
        if optim.lr_decay != "constant":
            schedule += f", {optim.lr_decay} decay over {optim.lr_decay_steps} steps to {optim.lr_floor:g} x"
        lines = [
            f"run {self.run_id} version {self.version} ({whose}{', private' if self.private else ''}):",
            f"  model {self.model}{source}: {model.arch}, {model.n_layers} blocks, vocabulary {model.vocab_size}, "
            f"fingerprint {self.source.fingerprint}, seed {self.source.seed}" + "".join(f", {e}" for e in extras),
            f"  split {self.split.num_stages} stages at blocks {','.join(map(str, self.split.boundaries))}",
            f"  optimizer {optim.optimizer}, {schedule}, weight decay {optim.weight_decay:g}, "
            f"target batch {optim.target_batch_size}",
            *(f"  version {c.version}: {c.describe()}" for c in self.changes),
            f"  averaging {replicas.averaging}" + (f", delay {replicas.sync_delay}" if replicas.sync_delay else ""),
            "  codec " + (self.codec.codec or "each trainer's --codec"),
        ]
        return "\n".join(lines)


def parse_spec(signed: SignedSpec) -> RunSpec:
    """The typed spec of a signed one; SpecError (one line) for anything that is not a valid spec."""
    try:
        return RunSpec.model_validate_json(signed.payload)
    except ValidationError as e:
        raise SpecError(f"the run's spec is not valid: {first_error(e)}") from None


def spec_payload(spec: RunSpec) -> str:
    return spec.model_dump_json()


def first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where + ': ' if where else ''}{first['msg']}"


# --- the spec of a swarm with no owner: its first peer's settings -----------------------------------


def run_id_for(model: str) -> str:
    """A run id from a model name (the run id of a swarm with no owner is its model's name)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", model)[:64]


def model_kind(config: PeerConfig | Any) -> ModelKind:
    if config.model_dir is not None:
        return "folder"
    return "user" if ":" in config.model else "named"


def spec_of_peer(
    config: PeerConfig,
    model: GPTConfig,
    boundaries: tuple[int, ...],
    *,
    created_at: float,
    init_weights_sha256: str = "",
) -> RunSpec:
    """What a peer of a swarm with no owner trains (its resolved model and its flags), as a spec."""
    replicas = {
        name: getattr(config.replicas, name) for name in ReplicasSpec.model_fields if name not in LOCAL_REPLICA_OPTIONS
    }
    optim = {name: getattr(config.optim, name) for name in OptimSpec.model_fields}
    payload = {
        "run_id": run_id_for(model.name),
        "version": 1,
        "model": model.name,
        "owned": False,
        "created_at": created_at,
        "source": {
            "kind": model_kind(config),
            "config": model.to_dict(),
            "fingerprint": model_fingerprint(model),
            "seed": config.seed,
            "init_weights_sha256": init_weights_sha256,
        },
        "split": {"num_stages": len(boundaries) - 1, "boundaries": list(boundaries)},
        "optim": optim,
        "replicas": replicas,
    }
    try:
        return RunSpec.model_validate_json(json.dumps(payload))
    except ValidationError as e:
        raise SpecError(f"this peer's settings do not make a run spec: {first_error(e)}") from None


def spec_options(spec: RunSpec) -> dict[str, Any]:
    """The peer options (leaf names of PeerConfig) the spec fixes, with its values."""
    model = spec.model_config_resolved
    return {
        "model": spec.model,
        "vocab_size": model.vocab_size,
        "trainable": model.trainable,
        "subspace_rank": model.subspace_rank,
        "subspace_kind": model.subspace_kind,
        "seed": spec.source.seed,
        "num_stages": spec.split.num_stages,
        **spec.optim.model_dump(),
        **spec.replicas.model_dump(),
    }


# --- files -------------------------------------------------------------------------------------------


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (hex; the first 32 characters), read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()[:32]


def write_spec(run_dir: str, signed: SignedSpec) -> str:
    """Write the signed spec into the run's folder, atomically; returns its path."""
    path = os.path.join(run_dir, SPEC_FILE)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(signed.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_owner_spec(run_dir: str, owner_key: str) -> SignedSpec | None:
    """The spec kept in a run's folder if its owner (`owner_key`) signed it (None: the folder has none);
    SpecError for a bad file or a signature that is not the owner's."""
    signed = read_spec(run_dir)
    if signed is not None and (signed.signer_key != owner_key or not signed.signed_by_key()):
        raise SpecError(
            f"the spec in {run_dir} is not signed by the owner of the run: it was changed, or is another run's"
        )
    return signed


def find_run_spec(
    runs: Collection[KnownRun], authority: RunAccessConfig, *, model: str | None, initial_peers: Iterable[str]
) -> SignedSpec | None:
    """The signed spec of the run a peer or trainer joins, among the runs announced on the DHT
    (`dht.run_specs.fetch_runs`), or None (a swarm with no spec yet): the run in force for its
    --run or its --credential's run (`run_in_force`; `model`: its --model if given); else the spec in
    --run's owner folder, not on the DHT yet; else, for a run with an authority but no spec of its
    own, the unowned spec its peers serve (its first peer's settings)."""
    run_file = load_run(authority.run) if authority.run is not None else None
    wanted = run_file.run_id if run_file is not None else credential_run_id(authority.credential)
    vouching = vouching_peers(initial_peers)
    owner_key = run_file.owner_public_key if run_file is not None else None
    chosen = run_in_force(runs, run_id=wanted, owner_key=owner_key, model=model, vouching=vouching)
    if chosen is not None:
        return chosen.spec
    if run_file is not None and os.path.isdir(authority.run):
        own = read_owner_spec(authority.run, run_file.owner_public_key)
        if own is not None:
            return own
    if wanted is not None:
        chosen = run_in_force(runs, model=model, vouching=vouching)
        if chosen is not None and not chosen.header.owned:
            return chosen.spec
    return None


def read_spec(run_dir: str) -> SignedSpec | None:
    """The signed spec kept in a run's folder (None: the folder has none); SpecError for a bad file."""
    path = os.path.join(run_dir, SPEC_FILE) if os.path.isdir(run_dir) else run_dir
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            return SignedSpec.model_validate_json(f.read())
    except OSError as e:
        raise SpecError(f"cannot read the run's spec {path!r}: {e.strerror}") from None
    except ValidationError as e:
        raise SpecError(f"{path!r} is not a signed run spec: {first_error(e)}") from None
