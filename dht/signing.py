"""Signed DHT records: a peer can write only its own record.

Every process signs and validates with hivemind's `RSASignatureValidator`. A record's subkey is
`<peer id>[owner:<RSA public key>]` (see dht/keys.py); hivemind then refuses to store or return a
value under that subkey unless it carries a valid signature by that key. That alone would let
anyone write a record naming *another* peer id under their own key, so the reader also checks the
binding: the peer id in the subkey must be the libp2p id of that public key (the sha256 multihash
of the key, as libp2p derives RSA peer ids). The signing key is therefore the node's libp2p
identity itself: `start_dht` makes (or loads) an RSA identity file and p2pd runs with it.

Unsigned subkeys (peers of versions before signing) and subkeys whose key does not match the peer
id are skipped with a warning (once per subkey), never parsed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import parse_peer_subkey

logger = logging.getLogger(__name__)


class IdentityError(ValueError):
    """An identity file that cannot sign records (unreadable, or not an RSA key)."""


@dataclass(frozen=True)
class SigningIdentity:
    """The node's libp2p identity, used to sign its DHT records."""

    private_key: RSAPrivateKey
    peer_id: str  # base58, as p2pd derives it from the key

    @property
    def owner_marker(self) -> bytes:
        """`[owner:<public key>]`: what a subkey carries to be protected by this key."""
        return self.validator().local_public_key

    def validator(self) -> RSASignatureValidator:
        return RSASignatureValidator(self.private_key)


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: sha256 multihash of its protobuf encoding."""
    der = public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def new_identity_file(path: str) -> SigningIdentity:
    """Write a fresh RSA libp2p identity (the format p2pd reads with -id), readable by its owner
    only, and return it (the key just generated: no need to read it back)."""
    inner = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # as hivemind's RSAPrivateKey()
    der = inner.private_bytes(
        encoding=serialization.Encoding.DER,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return _identity_of(inner)


def load_identity(path: str) -> SigningIdentity:
    """Read an identity file; raises `IdentityError` if it is unreadable or not an RSA key."""
    try:
        with open(path, "rb") as f:
            message = crypto_pb2.PrivateKey.FromString(f.read())
    except OSError as e:
        raise IdentityError(f"cannot read the identity file {path!r}: {e.strerror}") from None
    except Exception:  # protobuf raises its own DecodeError for garbage
        raise IdentityError(f"{path!r} is not a libp2p identity file") from None
    if message.key_type != crypto_pb2.KeyType.RSA:
        raise IdentityError(
            f"the identity in {path!r} is not an RSA key, and swarm signs its DHT records with "
            f"the node's RSA identity; remove the file to make a new one"
        )
    try:  # checked once here (an RSA key check costs about 50 ms of CPU), not again below
        inner = serialization.load_der_private_key(message.data, password=None)
    except ValueError:
        raise IdentityError(f"the RSA key in {path!r} is damaged") from None
    if not isinstance(inner, rsa.RSAPrivateKey):
        raise IdentityError(f"the identity in {path!r} is not an RSA key")
    return _identity_of(inner)


def _identity_of(inner: rsa.RSAPrivateKey) -> SigningIdentity:
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind's wrapper around this key, not a new one
    key.__dict__["_private_key"] = inner  # what its own unpickling (__setstate__) sets
    return SigningIdentity(private_key=key, peer_id=peer_id_of(inner.public_key()))


class BytesSubkeyValidator(RecordValidatorBase):
    """Refuses dictionary entries whose subkey is a text string. Every subkey swarm and hivemind's
    averagers write is bytes; a text subkey is an old unsigned record or a forgery, and hivemind
    1.1.12 fails (a store raises, a get never returns) on a dictionary that mixes both types, so
    letting one in would let a single bad record hide a whole stage."""

    def validate(self, record: DHTRecord) -> bool:
        # The subkey arrives msgpack-encoded: 0xa0-0xbf and 0xd9-0xdb start a str.
        return not (record.subkey and (0xA0 <= record.subkey[0] <= 0xBF or 0xD9 <= record.subkey[0] <= 0xDB))


def validators(identity: SigningIdentity, *guards: RecordValidatorBase) -> list[RecordValidatorBase]:
    """What every swarm DHT node signs and validates with (and `guards`: dht/record_policy.py's)."""
    return [identity.validator(), BytesSubkeyValidator(), *guards]


# Which identity signs for which running DHT node, and whose records it reads (filled by
# dht.node.start_dht).
_IDENTITIES: weakref.WeakKeyDictionary[Any, SigningIdentity] = weakref.WeakKeyDictionary()
_ALLOWED: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
_PLANNERS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def register(dht, identity: SigningIdentity, *, allowed_peers=(), plan_signers=()) -> None:
    _IDENTITIES[dht] = identity
    if allowed_peers:
        _ALLOWED[dht] = frozenset(allowed_peers)
    if plan_signers:
        _PLANNERS[dht] = frozenset(plan_signers)


def allowed_peers_of(dht) -> frozenset[str] | None:
    """The private swarm's allowlist this node reads records from, or None in an open swarm."""
    return _ALLOWED.get(dht)


def plan_signers_of(dht) -> frozenset[str] | None:
    """The peers whose placement plans this node follows (`--plan-signers`, else a private swarm's
    allowlist), or None: any peer's signed plan."""
    return _PLANNERS.get(dht, _ALLOWED.get(dht))


def identity_of(dht) -> SigningIdentity:
    try:
        return _IDENTITIES[dht]
    except KeyError:
        raise RuntimeError(
            "this DHT node was not started by dht.node.start_dht, so it has no signing identity"
        ) from None


# --- reading ---------------------------------------------------------------------------------------

_warned: set[Any] = set()


def _warn_once(subkey: Any, message: str) -> None:
    if len(_warned) > 10_000:
        _warned.clear()
    if subkey not in _warned:
        _warned.add(subkey)
        logger.warning(message)


def owned_entries(entries: dict[Any, Any], *, what: str, allowed: frozenset[str] | None = None) -> dict[str, Any]:
    """Keep the entries whose subkey is `<peer id>[owner:<key>]` with the key hashing to that peer
    id (hivemind's validator has already checked the signature) and, in a private swarm, the peer
    on the `allowed` list; re-key them by peer id."""
    owned: dict[str, Any] = {}
    for subkey, value in entries.items():
        parsed = parse_peer_subkey(subkey)
        if parsed is None:
            _warn_once(
                subkey,
                f"Skipping an unsigned {what} record {str(subkey)[:80]!r} (a peer of an older version, or a forgery)",
            )
            continue
        peer_id, key_bytes = parsed
        try:
            public_key = serialization.load_ssh_public_key(key_bytes)
            key_peer_id = peer_id_of(public_key) if isinstance(public_key, rsa.RSAPublicKey) else None
        except Exception:  # cryptography raises assorted errors for malformed keys
            key_peer_id = None
        if key_peer_id != peer_id:
            _warn_once(
                subkey,
                f"Skipping a {what} record that names peer {peer_id[:64]!r} but is signed by another key (a forgery)",
            )
            continue
        if allowed is not None and peer_id not in allowed:
            _warn_once(
                subkey,
                f"Skipping the {what} record of peer {peer_id}: it is not on this private swarm's --allowed-peers",
            )
            continue
        owned[peer_id] = value
    return owned
