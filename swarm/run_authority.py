"""`swarm run create`, `swarm run update` and `swarm run issue`: a run's owner makes the run, its
spec (what every process trains: peers/run_spec.py) and its versions, and signs credentials.

    swarm run create --out myrun --model small --lr 3e-4 ... [--spec run.toml] [--initial-peers ADDR]
        # myrun/owner.key (secret), myrun/run.json (public), myrun/spec.json (the signed spec)
    swarm run update --run-dir myrun --from-step 500 --lr 1e-4 --initial-peers ADDR
    swarm run issue --run-dir myrun --role trainer --peer-id 12D3KooW... --expires 7d --out trainer.cred

The spec is published on the DHT (`--initial-peers`), where every peer and trainer of the run reads
it. A TOML file gives the spec's options by table ([source], [optim], [replicas], [subspace],
[compression]); flags win over it. A new version changes only the learning-rate schedule, from a step
the run has not reached. Peers and trainers of a private run need `--credential FILE` with the
`--identity-path` it names. dht/authority.py has the rules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing

import torch
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from dht.announce import fetch_stage_records
from dht.authority import (
    ROLES,
    Credential,
    CredentialError,
    RunFileError,
    create_run,
    credential_summary,
    issue,
    load_owner_key,
    load_run,
    parse_duration,
    write_credential,
)
from dht.node import NetworkConfig, start_dht
from dht.record_policy import MAX_SPEC_TTL_S
from dht.run_specs import SpecError, announce_spec, sign_spec
from dht.signing import IdentityError, load_identity, new_identity_file
from models.subspace_options import SubspaceSettings
from peers.compute.stage_runtime import OptimizerSettings
from peers.config import PeerConfig, ReplicaSettings
from peers.run_spec import (
    LOCAL_REPLICA_OPTIONS,
    SCHEDULE_OPTIONS,
    CodecSpec,
    RunSpec,
    file_sha256,
    first_error,
    parse_spec,
    read_owner_spec,
    spec_payload,
    write_spec,
)
from peers.settle import settle
from process.config import ConfigError, option, record_model, section
from swarm.data.shards import META, TOKENIZER
from wire.compression.policy import CODEC_MODES

# The options of the spec's model and split, as `swarm peer` names them (one definition of each).
SOURCE_OPTIONS = (
    "model",
    "model_dir",
    "vocab_size",
    "trainable",
    "seed",
    "num_stages",
    "split_boundaries",
    "init_weights",
)


def _subset(cls: type, names: typing.Collection[str], name: str, doc: str) -> type:
    """A config section of some of `cls`'s options, with their defaults and help."""
    hints = typing.get_type_hints(cls)
    fields = []
    for field in dataclasses.fields(cls):
        if field.name in names:
            default = (
                {"default": field.default}
                if field.default is not dataclasses.MISSING
                else {"default_factory": field.default_factory}
            )
            fields.append((field.name, hints[field.name], dataclasses.field(metadata=field.metadata, **default)))
    made = dataclasses.make_dataclass(name, fields, kw_only=True)
    made.__doc__ = doc
    return made


RunSource = _subset(PeerConfig, SOURCE_OPTIONS, "RunSource", "The model a run trains and its split.")
RunReplicas = _subset(
    ReplicaSettings,
    [f.name for f in dataclasses.fields(ReplicaSettings) if f.name not in LOCAL_REPLICA_OPTIONS],
    "RunReplicas",
    "How the replicas of a run's stages agree.",
)


@dataclasses.dataclass(kw_only=True)
class RunCodec:
    codec: str | None = option(
        None,
        help="what crosses between stages, for every trainer of the run (none, fp16, int8, int4, topk, adaptive); "
        "default: each trainer's --codec",
        choices=CODEC_MODES,
    )
    topk_fraction: float = option(0.1, help="fraction of values top-k keeps (with --codec topk)")
    codec_loss_budget: float = option(0.02, help="with --codec adaptive: the validation-loss cost the codecs may add")

    def __post_init__(self) -> None:
        CodecSpec.model_validate(dataclasses.asdict(self))


# the tables of a spec's TOML file, and the section of RunCreateConfig each fills
SPEC_TABLES = {
    "source": RunSource,
    "optim": OptimizerSettings,
    "replicas": RunReplicas,
    "subspace": SubspaceSettings,
    "compression": RunCodec,
}


@dataclasses.dataclass(kw_only=True)
class RunCreateConfig:
    out: str | None = option(
        None,
        help="folder to create the run in: owner.key (keep it secret), run.json and spec.json (give them out)",
    )
    private: bool = option(
        False,
        help="a private run: every call to a peer needs a credential (an open run lets anyone serve, "
        "and only credential holders change or read the weights)",
    )
    run_id: str | None = option(None, help="the run's name (default: a random one)")
    spec: str | None = option(None, help="a TOML file with the spec's options by table; flags win over it")
    tokenizer: str | None = option(
        None, help="the run's tokenizer: a tokenizer.json, or a folder of `swarm data prepare` (its vocabulary too)"
    )
    source: RunSource = section(RunSource, help="the model and its split")
    optim: OptimizerSettings = section(OptimizerSettings, help="the optimizer and its schedule")
    replicas: RunReplicas = section(RunReplicas, help="how replicas agree")
    subspace: SubspaceSettings = section(SubspaceSettings, help="subspace compression between stages")
    compression: RunCodec = section(RunCodec, help="compression on the wire")
    network: NetworkConfig = section(NetworkConfig, help="publishing the spec on the swarm's DHT (--initial-peers)")

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("--out is required: the folder to create the run in")


@dataclasses.dataclass(kw_only=True)
class RunUpdateConfig:
    run_dir: str | None = option(None, help="the run's folder (from `swarm run create`), with its owner.key")
    from_step: int | None = option(None, help="the run's step from which the new version is in force")
    lr: float | None = option(None, help="the learning rate from then on")
    warmup_steps: int | None = option(None, help="warmup steps (counted from step 0, as the run's schedule)")
    lr_decay: str | None = option(None, help="constant, cosine or linear", choices=["constant", "cosine", "linear"])
    lr_decay_steps: int | None = option(None, help="steps after the warmup over which --lr-decay reaches its floor")
    lr_floor: float | None = option(None, help="the decayed learning rate, as a fraction of --lr")
    network: NetworkConfig = section(NetworkConfig, help="publishing the new version on the swarm's DHT")

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ConfigError("--run-dir is required: the run's folder, with its owner.key and spec.json")
        if self.from_step is None or self.from_step < 0:
            raise ConfigError("--from-step N is required: the run's step from which the new version is in force")
        if not self.network.initial_peers:
            raise ConfigError(
                "--initial-peers is required: the new version is published on the run's DHT, which also says "
                "the step the run is at"
            )

    @property
    def schedule(self) -> dict[str, typing.Any]:
        return {name: getattr(self, name) for name in SCHEDULE_OPTIONS if getattr(self, name) is not None}


@dataclasses.dataclass(kw_only=True)
class RunIssueConfig:
    run_dir: str | None = option(None, help="the run's folder (from `swarm run create`), with its owner.key")
    role: str | None = option(
        None, choices=ROLES, help="trainer (may change the weights) or peer (may serve and average)"
    )
    peer_id: str | None = option(None, help="the holder's peer id (it prints it at start-up)")
    holder_identity: str | None = option(
        None,
        help="instead of --peer-id: the holder's identity file (its --identity-path), whose peer id is read; "
        "made if it does not exist yet",
    )
    stage: int | None = option(None, help="peer credentials: the only stage it may average and download (default: any)")
    expires: str = option("7d", help="how long the credential is valid: e.g. 90s, 30m, 12h, 7d")
    out: str | None = option(None, help="file to write the credential to (give it to the holder)")

    def __post_init__(self) -> None:
        for name, value in (("--run-dir", self.run_dir), ("--role", self.role), ("--out", self.out)):
            if not value:
                raise ConfigError(f"{name} is required (see `swarm run issue --help`)")
        if self.role not in ROLES:
            raise ConfigError(f"--role {self.role!r}: a credential is for a trainer or a peer")
        if (self.peer_id is None) == (self.holder_identity is None):
            raise ConfigError("give the holder as --peer-id ID or --holder-identity FILE (one of them)")
        if self.stage is not None and self.stage < 0:
            raise ConfigError(f"--stage {self.stage}: stages are numbered from 0")


def spec_file_options(path: str) -> dict[str, typing.Any]:
    """The options a spec's TOML file gives, by leaf name; ConfigError (one line) for a file that
    does not parse, a table or key it should not have, or a value of the wrong type."""
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--spec {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--spec {path}: not TOML: {e}") from None
    values: dict[str, typing.Any] = {}
    for table, entries in tables.items():
        section_cls = SPEC_TABLES.get(table)
        if section_cls is None or not isinstance(entries, dict):
            raise ConfigError(
                f"--spec {path}: [{table}] is not a table of a run's spec (its tables: {', '.join(SPEC_TABLES)})"
            )
        record = record_model(section_cls)
        unknown = sorted(set(entries) - set(record.model_fields))
        if unknown:
            raise ConfigError(
                f"--spec {path}: [{table}] has no option {unknown[0]!r} (its options: {', '.join(record.model_fields)})"
            )
        try:
            checked = record.model_validate_json(json.dumps(entries))
        except ValidationError as e:
            raise ConfigError(f"--spec {path}: [{table}] {first_error(e)}") from None
        values.update({name: getattr(checked, name) for name in entries})
    return values


def run_create(config: RunCreateConfig, given: typing.Collection[str] = ()) -> int:
    """Make the run's folder (owner key, run file, signed spec) and publish the spec with --initial-peers."""
    spec = owner_spec(config, given)  # everything checked before anything is written
    run = create_run(config.out, private=config.private, run_id=config.run_id)
    owned = parse_spec_text(spec.model_copy(update={"run_id": run.run_id}))
    signed = sign_spec(load_owner_key(config.out, run), spec_payload(owned))
    write_spec(config.out, signed)
    print(
        f"created {'private' if run.private else 'open'} run {run.run_id} in {config.out}: "
        f"give {config.out}/run.json to every peer and trainer (--run); keep {config.out}/owner.key secret",
        flush=True,
    )
    print(owned.describe(), flush=True)
    if config.network.initial_peers:
        _publish(config.network, signed, f"run {run.run_id}'s spec")
    return 0


def owner_spec(config: RunCreateConfig, given: typing.Collection[str]) -> RunSpec:
    """The spec `swarm run create` signs: its flags over its --spec file over the defaults, the model
    resolved and split as a first peer would (peers/settle.py), stated as the owner's."""
    if config.spec is not None:
        options = spec_file_options(config.spec)
        kept = {name: value for name, value in options.items() if name not in given}
        config = _with_options(config, kept)
        given = {*given, *options}
    source = config.source
    vocab, tokenizer_sha = source.vocab_size, ""
    if config.tokenizer is not None:
        vocab, tokenizer_sha = _tokenizer(config.tokenizer, vocab)
    peer = PeerConfig(
        model=source.model,
        model_dir=source.model_dir,
        vocab_size=vocab,
        trainable=source.trainable,
        seed=source.seed,
        num_stages=source.num_stages,
        split_boundaries=source.split_boundaries,
        init_weights=source.init_weights,
        optim=config.optim,
        replicas=ReplicaSettings(**dataclasses.asdict(config.replicas)),
        subspace=config.subspace,
    )
    settled = settle(peer, {"model"}, None, device=torch.device("cpu"), available_bytes=1 << 60, created_at=0.0)
    codec = dataclasses.asdict(config.compression) if config.compression.codec is not None else {}
    source_spec = settled.spec.source.model_copy(update={"tokenizer_sha256": tokenizer_sha})
    return settled.spec.model_copy(
        update={
            "owned": True,
            "private": config.private,
            "created_at": get_dht_time(),
            "source": source_spec,
            "codec": CodecSpec(**codec),
        }
    )


def parse_spec_text(spec: RunSpec) -> RunSpec:
    """`spec` validated again as a whole (model_copy does not)."""
    try:
        return RunSpec.model_validate_json(spec.model_dump_json())
    except ValidationError as e:
        raise SpecError(f"the run's spec is not valid: {first_error(e)}") from None


def _with_options(config: RunCreateConfig, values: dict[str, typing.Any]) -> RunCreateConfig:
    changes = {}
    for table, section_cls in SPEC_TABLES.items():
        names = {f.name for f in dataclasses.fields(section_cls)}
        inner = {k: v for k, v in values.items() if k in names}
        if inner:
            section_now = getattr(config, table)
            current = {f.name: getattr(section_now, f.name) for f in dataclasses.fields(section_now) if f.init}
            changes[table] = section_cls(**(current | inner))
    return dataclasses.replace(config, **changes)


def _tokenizer(path: str, vocab: int | None) -> tuple[int | None, str]:
    """(vocabulary, sha256) of --tokenizer: a tokenizer.json, or a prepared data folder (its meta's vocabulary)."""
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, META)) as f:
                meta_vocab = int(json.load(f)["vocab_size"])
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"--tokenizer {path}: not a folder of `swarm data prepare` ({e})") from None
        if vocab is not None and vocab != meta_vocab:
            raise ConfigError(f"--vocab-size {vocab}: the data in {path} has a vocabulary of {meta_vocab}")
        vocab, path = meta_vocab, os.path.join(path, TOKENIZER)
    if not os.path.isfile(path):
        raise ConfigError(f"--tokenizer {path!r}: no such file")
    return vocab, file_sha256(path)


def _publish(network: NetworkConfig, signed, what: str) -> None:
    dht = start_dht(network, client_mode=True)
    try:
        if not announce_spec(dht, signed, ttl_s=MAX_SPEC_TTL_S):
            raise SpecError(f"could not store {what} on the DHT; is the bootstrap node reachable?")
        print(f"published {what} on the DHT (peers and trainers there read it from now on)", flush=True)
    finally:
        dht.shutdown()


def run_update(config: RunUpdateConfig) -> int:
    """Sign the next version of the run's spec, publish it, then keep it in the run's folder."""
    run = load_run(config.run_dir)
    owner_key = load_owner_key(config.run_dir, run)
    signed = read_owner_spec(config.run_dir, run.owner_public_key)  # a changed spec.json is refused
    if signed is None:
        raise SpecError(f"{config.run_dir} has no spec.json: `swarm run create` writes it")
    spec = parse_spec(signed)
    try:
        later = spec.with_change(from_step=config.from_step, **config.schedule)
    except ValueError as e:
        raise SpecError(str(e)) from None
    later = parse_spec_text(later)
    dht = start_dht(config.network, client_mode=True)
    try:
        at = max(
            (
                r.steps_done
                for s in range(spec.split.num_stages)
                for r in fetch_stage_records(dht, spec.model, s)
                if r.run_id in ("", spec.run_id)
            ),
            default=0,
        )
        if config.from_step < at:  # the step as the peers last announced it (every few seconds)
            raise SpecError(
                f"--from-step {config.from_step} is a past step: run {spec.run_id} is at step {at} already; "
                f"give --from-step {at} or later"
            )
        new = sign_spec(owner_key, spec_payload(later))
        if not announce_spec(dht, new, ttl_s=MAX_SPEC_TTL_S):
            raise SpecError("could not store the new version on the DHT; is the bootstrap node reachable?")
    finally:
        dht.shutdown()
    write_spec(config.run_dir, new)
    print(
        f"run {spec.run_id} version {later.version}: {later.changes[-1].describe()} (the run is at step {at}); "
        f"published and kept in {config.run_dir}",
        flush=True,
    )
    return 0


def run_issue(config: RunIssueConfig) -> int:
    run = load_run(config.run_dir)
    owner_key = load_owner_key(config.run_dir, run)
    peer_id = config.peer_id
    if config.holder_identity is not None:
        try:
            if os.path.exists(config.holder_identity):
                peer_id = load_identity(config.holder_identity).peer_id
            else:
                peer_id = new_identity_file(config.holder_identity).peer_id
                print(
                    f"made the identity file {config.holder_identity} (peer {peer_id}): give it to its holder "
                    "with the credential, as its --identity-path",
                    flush=True,
                )
        except IdentityError as e:
            raise RunFileError(str(e)) from None
        except OSError as e:
            raise RunFileError(f"cannot write the identity file {config.holder_identity!r}: {e.strerror}") from None
    try:
        signed = issue(
            owner_key,
            run,
            role=config.role,
            peer_id=peer_id,
            stage=config.stage,
            valid_for_s=parse_duration(config.expires),
        )
    except CredentialError as e:
        raise ConfigError(str(e)) from None
    write_credential(config.out, signed)
    held = Credential.model_validate_json(signed.payload)
    print(f"wrote {config.out}: {credential_summary(held)}, for peer {peer_id}", flush=True)
    return 0
