"""The run authority: who may change a run's weights, and (in a private run) who may take part at all.

A run is created by an owner identity (`swarm run create`): an RSA key like a node's libp2p identity
(dht/signing.py), and a public run file (`run.json`, a `RunInfo`: the run id, the owner's public key,
whether the run is private) that every process of the run is given (`--run`). The owner issues
credentials (`swarm run issue`): a `Credential` (run id, role trainer|peer, the holder's peer id, an
optional stage, an expiry) signed with the owner's key, which the holder keeps in a file and presents
(`--credential`).

A credential names its holder's libp2p peer id, which the transport authenticates, so a receiver
accepts it only from that peer: someone who copies it cannot use it (`RunAuthority.verify`).
What each role may do (peers/serving/admission.py enforces it):
- trainer: every gradient-affecting RPC (forward that caches for a backward, backward, commit) and
  state downloads;
- peer: averaging with the other replicas of its stage (or of any stage, when the credential names
  none), and state downloads of that stage;
- in a private run, every RPC needs a credential of either role; in an open run anyone may serve
  and run evaluation forwards, but only credential holders change or read the weights.

Everything here is pure (no network): signing, verifying, the files.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import uuid
from collections.abc import Collection
from typing import Literal

import base58
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dht.records import PeerRecord
from dht.signing import IdentityError, load_identity, new_identity_file
from process.config import ConfigError, option

Role = Literal["trainer", "peer"]
ROLES: tuple[str, ...] = ("trainer", "peer")
RUN_FILE = "run.json"
OWNER_KEY_FILE = "owner.key"
MAX_CREDENTIAL_BYTES = 4096  # a credential is ~700 bytes; a receiver refuses anything longer unread
MAX_CLOCK_SKEW_S = 300.0  # a credential is taken as valid this long past its expiry (other clocks drift)


class CredentialError(ValueError):
    """A credential that does not let its presenter do what it asked; the message says why."""


class RunFileError(ConfigError):
    """A run file, owner key or credential file that cannot be used; the message says which and why."""


class RunInfo(BaseModel):
    """The public description of a run, written by `swarm run create` and given to every process."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    run_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    owner_public_key: str = Field(min_length=1, max_length=2048)  # OpenSSH format, as hivemind writes it
    private: bool = False  # every RPC needs a credential, not only the weight-changing ones

    def public_key(self) -> RSAPublicKey:
        try:
            return RSAPublicKey.from_bytes(self.owner_public_key.encode())
        except Exception:  # cryptography raises assorted errors for malformed keys
            raise RunFileError(f"the owner key of run {self.run_id!r} is not an RSA public key") from None


class Credential(BaseModel):
    """What the owner states about one holder."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    run_id: str = Field(min_length=1, max_length=64)
    role: Role
    peer_id: str = Field(min_length=1, max_length=128)
    stage: int | None = Field(default=None, ge=0)
    expires_at: float  # unix time


class SignedCredential(BaseModel):
    """A credential as it travels: the exact JSON the owner signed, and the signature (base64)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    payload: str = Field(max_length=1024)
    signature: str = Field(max_length=1024)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def is_peer_id(text: str) -> bool:
    try:
        return 30 <= len(base58.b58decode(text)) <= 64
    except ValueError:
        return False


# --- issuing ---------------------------------------------------------------------------------------


def sign_credential(owner_key: RSAPrivateKey, credential: Credential) -> SignedCredential:
    payload = credential.model_dump_json()
    return SignedCredential(payload=payload, signature=owner_key.sign(payload.encode()).decode())


def issue(
    owner_key: RSAPrivateKey,
    run: RunInfo,
    *,
    role: str,
    peer_id: str,
    stage: int | None = None,
    valid_for_s: float,
    now: float | None = None,
) -> SignedCredential:
    if role not in ROLES:
        raise CredentialError(f"unknown role {role!r}; a credential is for a trainer or a peer")
    if not is_peer_id(peer_id):
        raise CredentialError(f"{peer_id!r} is not a peer id (they look like Qm... or 12D3KooW...)")
    if valid_for_s <= 0:
        raise CredentialError("a credential must be valid for some time")
    now = time.time() if now is None else now
    credential = Credential(run_id=run.run_id, role=role, peer_id=peer_id, stage=stage, expires_at=now + valid_for_s)
    return sign_credential(owner_key, credential)


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `12h`, `7d` (or plain seconds) -> seconds; CredentialError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise CredentialError(f"{text!r} is not a duration; write e.g. 90s, 30m, 12h or 7d")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


# --- verifying -------------------------------------------------------------------------------------


class RunAuthority:
    """Checks credentials presented for one run. Verified credentials are cached by their bytes, so
    a caller that presents the same one on every request costs one RSA verification."""

    def __init__(self, run: RunInfo, *, max_cached: int = 4096):
        self.run = run
        self._public_key = run.public_key()
        self._verified: dict[bytes, Credential] = {}
        self._max_cached = max_cached

    @property
    def private(self) -> bool:
        return self.run.private

    def parse(self, data: bytes) -> Credential:
        """The credential in `data` if the owner signed it for this run (whoever presents it)."""
        cached = self._verified.get(data)
        if cached is not None:
            return cached
        if len(data) > MAX_CREDENTIAL_BYTES:
            raise CredentialError(f"a credential of {len(data)} bytes is longer than {MAX_CREDENTIAL_BYTES}")
        try:
            signed = SignedCredential.model_validate_json(data)
        except ValidationError:
            raise CredentialError("the credential is malformed") from None
        if not self._public_key.verify(signed.payload.encode(), signed.signature.encode()):
            raise CredentialError(f"the credential is not signed by the owner of run {self.run.run_id!r}")
        try:
            credential = Credential.model_validate_json(signed.payload)
        except ValidationError:
            raise CredentialError("the credential's payload is malformed") from None
        if credential.run_id != self.run.run_id:
            raise CredentialError(f"the credential is for run {credential.run_id!r}, not {self.run.run_id!r}")
        if len(self._verified) >= self._max_cached:
            self._verified.clear()
        self._verified[data] = credential
        return credential

    def verify(
        self,
        data: bytes | None,
        *,
        peer_id: str,
        roles: tuple[str, ...] = ROLES,
        stage: int | None = None,
        now: float | None = None,
    ) -> Credential:
        """The credential `data` if it lets `peer_id` act in one of `roles` (on `stage`, when given)
        now; raises `CredentialError` saying why not."""
        if not data:
            raise CredentialError(
                f"run {self.run.run_id!r} needs a credential for this (as a {' or '.join(roles)}); "
                f"ask the run's owner for one (`swarm run issue`) and pass it with --credential"
            )
        credential = self.parse(data)
        if credential.peer_id != peer_id:
            raise CredentialError(
                f"the credential was issued to peer {credential.peer_id}, not to {peer_id} who presented it"
            )
        now = time.time() if now is None else now
        if credential.expires_at + MAX_CLOCK_SKEW_S < now:
            raise CredentialError(f"the credential of peer {peer_id[-8:]} expired; ask the run's owner for a new one")
        if credential.role not in roles:
            raise CredentialError(f"a {credential.role} credential does not allow this (needs {' or '.join(roles)})")
        if stage is not None and credential.stage is not None and credential.stage != stage:
            raise CredentialError(f"the credential of peer {peer_id[-8:]} is for stage {credential.stage}, not {stage}")
        return credential


def credentialed_records(
    records: Collection[PeerRecord], authority: RunAuthority, *, stage: int | None = None, now: float | None = None
) -> list[PeerRecord]:
    """The records that carry a valid peer credential of their own peer (for `stage`, when given).
    A record is signed by the peer it names (dht/signing.py), so its credential cannot be borrowed."""
    kept = []
    for record in records:
        if not record.credential:
            continue
        try:
            authority.verify(record.credential.encode(), peer_id=record.peer_id, roles=("peer",), stage=stage, now=now)
        except CredentialError:
            continue
        kept.append(record)
    return kept


# --- files -----------------------------------------------------------------------------------------


def create_run(out_dir: str, *, private: bool, run_id: str | None = None) -> RunInfo:
    """Make `out_dir` with a new owner key (`owner.key`, readable by its owner only: keep it secret)
    and the public run file (`run.json`: give it to every peer and trainer)."""
    os.makedirs(out_dir, exist_ok=True)
    key_path, run_path = os.path.join(out_dir, OWNER_KEY_FILE), os.path.join(out_dir, RUN_FILE)
    for path in (key_path, run_path):
        if os.path.exists(path):
            raise RunFileError(f"{path} exists already; a run is created once (choose another --out)")
    try:
        new_identity_file(key_path)
    except OSError as e:
        raise RunFileError(f"cannot write the owner key {key_path!r}: {e.strerror}") from None
    owner = load_identity(key_path)
    run = RunInfo(
        run_id=run_id or uuid.uuid4().hex[:16],
        owner_public_key=owner.private_key.get_public_key().to_bytes().decode(),
        private=private,
    )
    _write(run_path, run.model_dump_json(indent=2) + "\n")
    return run


def load_run(path: str) -> RunInfo:
    if os.path.isdir(path):
        path = os.path.join(path, RUN_FILE)
    try:
        with open(path, "rb") as f:
            run = RunInfo.model_validate_json(f.read())
    except OSError as e:
        raise RunFileError(f"cannot read the run file {path!r}: {e.strerror}") from None
    except ValidationError as e:
        raise RunFileError(f"{path!r} is not a run file (`swarm run create` writes one): {_first_error(e)}") from None
    run.public_key()  # RunFileError if the key is not usable
    return run


def load_owner_key(run_dir: str, run: RunInfo) -> RSAPrivateKey:
    path = os.path.join(run_dir, OWNER_KEY_FILE)
    try:
        owner = load_identity(path)
    except IdentityError as e:
        raise RunFileError(f"{e} (the run's owner key, written by `swarm run create`)") from None
    if owner.private_key.get_public_key().to_bytes().decode() != run.owner_public_key:
        raise RunFileError(f"{path} is not the owner key of run {run.run_id!r}")
    return owner.private_key


def write_credential(path: str, signed: SignedCredential) -> None:
    _write(path, signed.model_dump_json() + "\n")


def read_credential(path: str) -> bytes:
    """A credential file's bytes as they are presented (whitespace trimmed)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CREDENTIAL_BYTES + 1).strip()
    except OSError as e:
        raise RunFileError(f"cannot read the credential file {path!r}: {e.strerror}") from None
    return data


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc']) or 'file'}: {first['msg']}"


# --- what a process is given -----------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class RunAccessConfig:
    """The run a peer or trainer takes part in (a section of their configs)."""

    run: str | None = option(
        None,
        help="the run's public file (run.json from `swarm run create`) or the owner's folder (this process then issues "
        "itself a credential); unset: no run authority, anyone may train",
    )
    credential: str | None = option(
        None,
        help="this process's credential for the run (from `swarm run issue`; it names the run), with the "
        "--identity-path it was issued to",
    )


@dataclasses.dataclass(frozen=True)
class RunAccess:
    """A process's run, loaded: the authority that checks others, and its own credential."""

    authority: RunAuthority
    credential: bytes | None  # presented as it is
    held: Credential | None  # what it says


NO_RUN_WARNING = (
    "no run authority (--run): anyone who can reach this swarm may train it, average with its replicas and "
    "send them state; create a run with `swarm run create` and give its folder to your own processes (SECURITY.md)"
)
SELF_ISSUED_VALID_S = 30 * 86400.0  # a credential the owner's own process issues itself at start-up


def load_run_access(
    config: RunAccessConfig, *, peer_id: str, roles: tuple[str, ...] = ROLES, run: RunInfo | None = None
) -> RunAccess | None:
    """The run of `config` (or `run`, a run known from its spec) for the process running as `peer_id`
    in one of `roles`, its own credential checked (so a wrong, expired or another identity's credential
    fails at start-up, not on every call). None: the process takes part in no run with an authority.
    A process of the run's owner (`--run` names the run's folder, which holds the owner key) without
    `--credential` issues itself one, for `roles[0]`: the owner's peers and trainers need no
    `swarm run issue` (that is how `swarm demo` and every local swarm run, LocalSwarm)."""
    if run is None and config.run is not None:
        run = load_run(config.run)
    if run is None:
        if config.credential is not None:
            raise RunFileError(
                f"--credential {config.credential}: this swarm serves no run with an owner for it to be a "
                "credential of (give the run's file with --run)"
            )
        return None
    authority = RunAuthority(run)
    if config.credential is None:
        owner_key = _owner_key_beside(config.run, run) if config.run is not None else None
        if owner_key is None:
            return RunAccess(authority, None, None)
        signed = issue(owner_key, run, role=roles[0], peer_id=peer_id, valid_for_s=SELF_ISSUED_VALID_S)
        data = signed.to_bytes()
        return RunAccess(authority, data, authority.verify(data, peer_id=peer_id, roles=roles))
    data = read_credential(config.credential)
    try:
        role = authority.parse(data).role
        if role not in roles:
            raise RunFileError(
                f"--credential {config.credential} is a {role} credential; this process needs a "
                f"{' or '.join(roles)} credential (`swarm run issue --role {roles[0]}`)"
            )
        held = authority.verify(data, peer_id=peer_id, roles=roles)
    except CredentialError as e:
        hint = " (give this process the --identity-path it was issued for)" if "issued to" in str(e) else ""
        raise RunFileError(f"--credential {config.credential}: {e}{hint}") from None
    return RunAccess(authority, data, held)


def _owner_key_beside(run_path: str, run: RunInfo) -> RSAPrivateKey | None:
    """The run's owner key, when `run_path` is the run's folder (or its run.json) and the key is there."""
    folder = run_path if os.path.isdir(run_path) else os.path.dirname(os.path.abspath(run_path))
    if not os.path.isfile(os.path.join(folder, OWNER_KEY_FILE)):
        return None
    return load_owner_key(folder, run)


def credential_run_id(path: str | None) -> str | None:
    """The run id a credential file names (unverified: its signature is checked once the run's key is known)."""
    if path is None:
        return None
    try:
        return Credential.model_validate_json(
            SignedCredential.model_validate_json(read_credential(path)).payload
        ).run_id
    except ValidationError:
        raise RunFileError(f"--credential {path}: not a credential file (`swarm run issue` writes one)") from None


def credential_summary(credential: Credential) -> str:
    stage = f" for stage {credential.stage}" if credential.stage is not None else ""
    left_h = (credential.expires_at - time.time()) / 3600
    return f"{credential.role} credential of run {credential.run_id}{stage}, valid {left_h:.1f} h more"
