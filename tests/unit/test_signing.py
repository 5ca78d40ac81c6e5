"""Record ownership (dht/signing.py): a subkey binds a peer id to the RSA key that must sign it,
and readers keep only entries whose key is that peer's identity (and, in a private swarm, whose
peer is on the allowlist)."""

from __future__ import annotations

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from dht.keys import parse_peer_subkey, peer_subkey
from dht.node import NetworkConfig
from dht.signing import BytesSubkeyValidator, IdentityError, load_identity, new_identity_file, owned_entries
from process.config import ConfigError


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ids")
    result = []
    for name in ("a", "b"):
        new_identity_file(str(folder / name))
        result.append((load_identity(str(folder / name)), (folder / name).read_bytes()))
    return result


def test_the_identity_peer_id_is_the_one_libp2p_derives(identities):
    for identity, raw in identities:
        assert identity.peer_id == PeerID.from_identity(raw).to_base58()
        assert identity.peer_id.startswith("Qm")


def test_a_new_identity_is_the_one_its_file_holds(tmp_path):
    """`new_identity_file` returns the identity it wrote (no second read): the same peer id, and
    what it signs verifies under the key read back from the file."""
    path = str(tmp_path / "id.key")
    made = new_identity_file(path)
    read = load_identity(path)
    assert made.peer_id == read.peer_id == PeerID.from_identity((tmp_path / "id.key").read_bytes()).to_base58()
    assert made.owner_marker == read.owner_marker
    signature = made.private_key.sign(b"record")
    assert read.private_key.get_public_key().verify(b"record", signature)


def test_readers_keep_only_entries_signed_by_the_named_peer(identities):
    (a, _), (b, _) = identities
    entries = {
        peer_subkey(a.peer_id, a.owner_marker): "a's own",
        peer_subkey(b.peer_id, a.owner_marker): "a pretending to be b",
        b.peer_id: "old unsigned format",
        b"garbage[owner:ssh-rsa AAAA]": "bad key",
    }
    assert owned_entries(entries, what="test") == {a.peer_id: "a's own"}
    assert parse_peer_subkey(peer_subkey(a.peer_id, a.owner_marker)) == (a.peer_id, a.owner_marker[7:-1])


def test_a_private_swarm_reads_only_allowed_peers(identities):
    (a, _), (b, _) = identities
    entries = {peer_subkey(a.peer_id, a.owner_marker): 1, peer_subkey(b.peer_id, b.owner_marker): 2}
    assert owned_entries(entries, what="test", allowed=frozenset([b.peer_id])) == {b.peer_id: 2}
    assert owned_entries(entries, what="test") == {a.peer_id: 1, b.peer_id: 2}


def test_text_subkeys_are_refused_and_bytes_subkeys_pass():
    validator = BytesSubkeyValidator()
    for subkey, ok in [("peer", False), ("x" * 100, False), (b"peer", True), (None, True), (b"", True)]:
        record = DHTRecord(key=b"k", subkey=MSGPackSerializer.dumps(subkey), value=b"v", expiration_time=0.0)
        assert validator.validate(record) is ok, subkey


def test_identity_files_that_cannot_sign_are_refused(tmp_path):
    (tmp_path / "junk").write_bytes(b"\x00\x01not a key")
    with pytest.raises(IdentityError):
        load_identity(str(tmp_path / "junk"))
    with pytest.raises(IdentityError, match="cannot read"):
        load_identity(str(tmp_path / "missing"))


def test_allowed_peers_must_be_peer_ids(identities):
    NetworkConfig(allowed_peers=[identities[0][0].peer_id])
    with pytest.raises(ConfigError, match="is not a peer id"):
        NetworkConfig(allowed_peers=["alice"])
