"""`swarm run create` and `swarm run issue`: a run's owner makes the run and signs credentials.

    swarm run create --out myrun [--private]     # myrun/owner.key (secret), myrun/run.json (public)
    swarm run issue --run-dir myrun --role trainer --peer-id 12D3KooW... --expires 7d --out trainer.cred

Peers and trainers are then started with `--run myrun/run.json --credential FILE --identity-path
KEY` (the identity whose peer id the credential names). dht/authority.py has the rules.
"""

from __future__ import annotations

import dataclasses

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
from dht.signing import IdentityError, load_identity
from process.config import ConfigError, option


@dataclasses.dataclass(kw_only=True)
class RunCreateConfig:
    out: str | None = option(
        None, help="folder to create the run in: owner.key (keep it secret) and run.json (give it to everyone)"
    )
    private: bool = option(
        False,
        help="a private run: every call to a peer needs a credential (an open run lets anyone serve, "
        "and only credential holders change or read the weights)",
    )
    run_id: str | None = option(None, help="the run's name (default: a random one)")

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("--out is required: the folder to create the run in")


@dataclasses.dataclass(kw_only=True)
class RunIssueConfig:
    run_dir: str | None = option(None, help="the run's folder (from `swarm run create`), with its owner.key")
    role: str | None = option(
        None, choices=ROLES, help="trainer (may change the weights) or peer (may serve and average)"
    )
    peer_id: str | None = option(None, help="the holder's peer id (it prints it at start-up)")
    holder_identity: str | None = option(
        None, help="instead of --peer-id: the holder's identity file (--identity-path), whose peer id is read"
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


def run_create(config: RunCreateConfig) -> int:
    run = create_run(config.out, private=config.private, run_id=config.run_id)
    print(
        f"created {'private' if run.private else 'open'} run {run.run_id} in {config.out}: "
        f"give {config.out}/run.json to every peer and trainer (--run); keep {config.out}/owner.key secret",
        flush=True,
    )
    return 0


def run_issue(config: RunIssueConfig) -> int:
    run = load_run(config.run_dir)
    owner_key = load_owner_key(config.run_dir, run)
    peer_id = config.peer_id
    if config.holder_identity is not None:
        try:
            peer_id = load_identity(config.holder_identity).peer_id
        except IdentityError as e:
            raise RunFileError(str(e)) from None
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
