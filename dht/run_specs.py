"""Runs' specs on the DHT, and which run a process joins.

A run's spec (peers/run_spec.py: model, split, optimizer, schedule, averaging, codec) travels as a
`SignedSpec`: its JSON text, signed by the run's owner key (dht/authority.py) or, in a swarm with no
owner, by the node key of the peer that started it. Every peer re-announces the spec it serves
under the runs key (dht/keys.py; subkey: its own peer id), so a spec lives as long as its run. Here
only the spec's header (`SpecHeader`) is read. Which run a process joins (`run_in_force`, pure):
- given its run (--run, or its credential's run id), that run only;
- else a run its --initial-peers announce themselves;
- else the only run; several runs of one model with no owner: the earliest claim (then the signer's
  peer id), which two first peers that raced agree on; anything else is refused, naming the runs.
Per run (run id and signer key), the highest version counts.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dht.keys import peer_subkey, runs_key
from dht.subkey_records import await_store, lookup, lookup_async, parse_entries, restamping_store, wait_store
from process.config import ConfigError

if TYPE_CHECKING:
    import hivemind
    from hivemind.utils.crypto import RSAPrivateKey

MAX_SPEC_CHARS = 24_000  # a spec is about 3 KB; a DHT value of the runs key may hold 32 KiB
SPEC_TTL_S = 600.0  # a peer's announcement of its spec; renewed at half of it
RUN_ID_PATTERN = r"^[A-Za-z0-9_.-]+$"


class SpecError(ConfigError):
    """No run to join, several to choose from, or a spec that cannot be used; the message says which."""


class SpecHeader(BaseModel):
    """What every version of a spec states first: whose run, which version, of which model."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    run_id: str = Field(min_length=1, max_length=64, pattern=RUN_ID_PATTERN)
    version: int = Field(ge=1, le=1_000_000)
    model: str = Field(min_length=1, max_length=128)
    owned: bool  # signed by a run's owner (`swarm run create`), or by the first peer of a swarm with no owner
    created_at: float = Field(allow_inf_nan=False)  # (DHT) time of version 1: the earlier of two first peers wins


class SignedSpec(BaseModel):
    """A spec as it travels and is kept in the run folder: the exact JSON signed, its signature
    (base64) and the signer's public key (OpenSSH, as hivemind writes it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    payload: str = Field(min_length=2, max_length=MAX_SPEC_CHARS)
    signature: str = Field(min_length=1, max_length=1024)
    signer_key: str = Field(min_length=1, max_length=2048)

    def header(self) -> SpecHeader:
        """The payload's header; ValueError when the payload is not a spec."""
        try:
            return SpecHeader.model_validate_json(self.payload)
        except ValidationError as e:
            raise ValueError(f"not a run spec: {_first_error(e)}") from None

    def signed_by_key(self) -> bool:
        """Whether `signature` is the signer key's signature of `payload`."""
        from hivemind.utils.crypto import RSAPublicKey

        try:
            key = RSAPublicKey.from_bytes(self.signer_key.encode())
            return bool(key.verify(self.payload.encode(), self.signature.encode()))
        except Exception:  # cryptography raises assorted errors for malformed keys and signatures
            return False

    @property
    def signer_id(self) -> str:
        """The libp2p peer id of the signer's key ('' for a key that is not RSA)."""
        from cryptography.hazmat.primitives import serialization

        from dht.signing import peer_id_of

        try:
            return peer_id_of(serialization.load_ssh_public_key(self.signer_key.encode()))
        except Exception:  # a malformed or non-RSA key
            return ""

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.payload.encode()).hexdigest()[:16]


def sign_spec(key: RSAPrivateKey, payload: str) -> SignedSpec:
    return SignedSpec(
        payload=payload,
        signature=key.sign(payload.encode()).decode(),
        signer_key=key.get_public_key().to_bytes().decode(),
    )


class SpecAnnouncement(BaseModel):
    """One announcer's statement under the runs key: the spec of the run it serves (or publishes)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=128)
    spec: SignedSpec
    expires_at: float

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: Any) -> SpecAnnouncement:
        if not isinstance(value, dict):
            raise ValueError(f"a spec announcement must be a mapping, got {type(value).__name__}")
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            raise ValueError(f"malformed spec announcement: {_first_error(e)}") from None


# --- the rules ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownRun:
    """A run as the announcements show it: its highest version, and who announces the run."""

    spec: SignedSpec
    header: SpecHeader
    announcers: frozenset[str]

    @property
    def identity(self) -> tuple[str, str]:
        return self.header.run_id, self.spec.signer_key

    def describe(self) -> str:
        whose = "its owner" if self.header.owned else "its first peer"
        return (
            f"run {self.header.run_id!r} of {self.header.model} (version {self.header.version}, signed by {whose} "
            f"{self.spec.signer_id[-8:]}, announced by {len(self.announcers)})"
        )


def known_runs(announcements: Iterable[SpecAnnouncement]) -> list[KnownRun]:
    """The runs whose specs carry a valid signature, each at its highest version (a tie between two
    payloads of one version, which an honest owner never signs, goes to the lower digest), sorted by run id."""
    best: dict[tuple[str, str], tuple[SignedSpec, SpecHeader]] = {}
    announcers: dict[tuple[str, str], set[str]] = {}
    checked: dict[tuple[str, str, str], bool] = {}  # one RSA verification per signed text
    for announcement in announcements:
        spec = announcement.spec
        signed = (spec.digest, spec.signature, spec.signer_key)
        if signed not in checked:
            checked[signed] = spec.signed_by_key()
        if not checked[signed]:
            continue
        try:
            header = spec.header()
        except ValueError:
            continue
        identity = (header.run_id, spec.signer_key)
        announcers.setdefault(identity, set()).add(announcement.peer_id)
        held = best.get(identity)
        if held is None or (header.version, _neg(spec.digest)) > (held[1].version, _neg(held[0].digest)):
            best[identity] = (spec, header)
    runs = [KnownRun(spec, header, frozenset(announcers[identity])) for identity, (spec, header) in best.items()]
    return sorted(runs, key=lambda run: (run.header.run_id, run.spec.signer_id))


def _neg(digest: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in digest)


def run_in_force(
    runs: Collection[KnownRun],
    *,
    run_id: str | None = None,
    owner_key: str | None = None,
    model: str | None = None,
    vouching: Collection[str] = (),
) -> KnownRun | None:
    """The run a process joins, or None when there is none for it (see the module's docstring).
    `run_id`/`owner_key`: the process's own run (--run's file, or its credential); `model`: the model
    it was told to serve (its --model), or None; `vouching`: the peer ids of its --initial-peers.
    Raises SpecError when several runs remain."""
    candidates = list(runs)
    if owner_key is not None:
        candidates = [r for r in candidates if r.spec.signer_key == owner_key and r.header.owned]
    if run_id is not None:
        candidates = [r for r in candidates if r.header.run_id == run_id]
    if model is not None:
        candidates = [r for r in candidates if r.header.model == model]
    vouched = [r for r in candidates if r.announcers & set(vouching)]
    candidates = vouched or candidates
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    if not any(r.header.owned for r in candidates) and len({r.header.model for r in candidates}) == 1:
        return min(candidates, key=lambda r: (r.header.created_at, r.spec.signer_id))
    listed = "; ".join(r.describe() for r in candidates)
    raise SpecError(
        f"this swarm serves {len(candidates)} runs: {listed}; choose one with --run (its run.json or run id)"
    )


def vouching_peers(initial_peers: Iterable[str]) -> frozenset[str]:
    """The peer ids named in multiaddrs (`.../p2p/<id>`)."""
    found = set()
    for maddr in initial_peers:
        match = re.search(r"/p2p/([1-9A-HJ-NP-Za-km-z]+)", maddr)
        if match:
            found.add(match.group(1))
    return frozenset(found)


# --- DHT I/O -----------------------------------------------------------------------------------------


def _store(dht: hivemind.DHT, spec: SignedSpec, ttl_s: float):
    from hivemind.utils import get_dht_time

    from dht.signing import identity_of

    identity = identity_of(dht)
    announcement = SpecAnnouncement(peer_id=identity.peer_id, spec=spec, expires_at=get_dht_time() + ttl_s)
    return restamping_store(dht, runs_key(), peer_subkey(identity.peer_id, identity.owner_marker), announcement)


def announce_spec(dht: hivemind.DHT, spec: SignedSpec, *, ttl_s: float = SPEC_TTL_S, timeout_s: float = 10.0) -> bool:
    """State on the DHT that this node serves (or publishes) `spec` (blocking); whether it was stored."""
    return wait_store(_store(dht, spec, ttl_s), timeout_s=timeout_s, what="Announcing the run's spec")


async def announce_spec_async(
    dht: hivemind.DHT, spec: SignedSpec, *, ttl_s: float = SPEC_TTL_S, timeout_s: float = 10.0
) -> bool:
    return await await_store(_store(dht, spec, ttl_s), timeout_s=timeout_s, what="Announcing the run's spec")


def _parse(dht: hivemind.DHT, entries: dict) -> list[KnownRun]:
    from dht.signing import allowed_peers_of, owned_entries

    owned = owned_entries(entries, what="run spec", allowed=allowed_peers_of(dht))

    def misplaced(subkey, announcement: SpecAnnouncement) -> str | None:
        return None if announcement.peer_id == subkey else f"it names peer {announcement.peer_id}"

    parsed = parse_entries(owned, SpecAnnouncement.from_wire, misplaced, kind="spec announcement", where="runs")
    return known_runs(parsed)


def fetch_runs(dht: hivemind.DHT, *, timeout_s: float = 10.0) -> list[KnownRun]:
    """Every run announced on the DHT (blocking; SpecError when the DHT does not answer)."""
    try:
        return _parse(dht, lookup(dht, runs_key(), timeout_s=timeout_s))
    except TimeoutError:
        raise SpecError(f"could not read the runs' specs from the DHT within {timeout_s:.0f} s") from None


async def fetch_runs_async(dht: hivemind.DHT, *, timeout_s: float = 10.0) -> list[KnownRun] | None:
    """Every run announced on the DHT; None (with a warning) when the lookup times out."""
    entries = await lookup_async(dht, runs_key(), timeout_s=timeout_s, what="the runs' specs")
    return None if entries is None else _parse(dht, entries)


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc']) or 'spec'}: {first['msg']}"
