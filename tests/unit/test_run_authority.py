"""The run authority (dht/authority.py): credentials signed by a run's owner, bound to the holder's
peer id, with an expiry; the policy the admission guard applies with them."""

from __future__ import annotations

import json
import time

import pytest

from dht.authority import (
    MAX_CLOCK_SKEW_S,
    CredentialError,
    RunAccessConfig,
    RunAuthority,
    RunFileError,
    SignedCredential,
    create_run,
    issue,
    load_owner_key,
    load_run,
    load_run_access,
    parse_duration,
    read_credential,
    write_credential,
)
from dht.records import PeerRecord, PeerState
from dht.signing import load_identity, new_identity_file
from peers.replicas.averaging_members import capped_weight, credentialed_members, declared_weights, median_weight
from peers.serving.admission import AdmissionGuard, NotAuthorizedError
from swarm.run_authority import RunIssueConfig, run_issue
from wire.request_limits import PenaltyBox


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One open and one private run, an owner key each, and two holder identities."""
    root = tmp_path_factory.mktemp("runs")
    runs = {name: create_run(str(root / name), private=name == "private") for name in ("open", "private")}
    keys = {name: load_owner_key(str(root / name), run) for name, run in runs.items()}
    ids = {}
    for name in ("alice", "mallory"):
        new_identity_file(str(root / f"{name}.key"))
        ids[name] = load_identity(str(root / f"{name}.key")).peer_id
    return root, runs, keys, ids


def _issue(world, run="open", role="trainer", holder="alice", stage=None, valid_for_s=3600.0, now=None):
    _, runs, keys, ids = world
    return issue(keys[run], runs[run], role=role, peer_id=ids[holder], stage=stage, valid_for_s=valid_for_s, now=now)


def test_a_credential_verifies_for_its_holder_only(world):
    _, runs, _, ids = world
    authority = RunAuthority(runs["open"])
    data = _issue(world).to_bytes()
    held = authority.verify(data, peer_id=ids["alice"], roles=("trainer",))
    assert (held.role, held.peer_id, held.run_id) == ("trainer", ids["alice"], runs["open"].run_id)
    with pytest.raises(CredentialError, match="issued to peer"):  # a copied credential is useless
        authority.verify(data, peer_id=ids["mallory"])


def test_expired_wrong_role_wrong_stage_and_no_credential_are_refused(world):
    _, runs, _, ids = world
    authority = RunAuthority(runs["open"])
    old = _issue(world, valid_for_s=60, now=time.time() - 120 - MAX_CLOCK_SKEW_S).to_bytes()
    with pytest.raises(CredentialError, match="expired"):
        authority.verify(old, peer_id=ids["alice"])
    peer = _issue(world, role="peer", stage=1).to_bytes()
    with pytest.raises(CredentialError, match="peer credential does not allow"):
        authority.verify(peer, peer_id=ids["alice"], roles=("trainer",))
    with pytest.raises(CredentialError, match="stage 1, not 0"):
        authority.verify(peer, peer_id=ids["alice"], roles=("peer",), stage=0)
    assert authority.verify(peer, peer_id=ids["alice"], roles=("peer",), stage=1).stage == 1
    with pytest.raises(CredentialError, match="needs a credential"):
        authority.verify(None, peer_id=ids["alice"])


def test_forged_tampered_and_other_runs_credentials_are_refused(world):
    _, runs, _, ids = world
    authority = RunAuthority(runs["open"])
    other_run = _issue(world, run="private").to_bytes()  # signed by another owner
    with pytest.raises(CredentialError, match="not signed by the owner"):
        authority.verify(other_run, peer_id=ids["alice"])
    signed = _issue(world, role="peer")
    payload = json.loads(signed.payload)
    payload["role"] = "trainer"  # a peer promotes itself
    tampered = SignedCredential(payload=json.dumps(payload), signature=signed.signature).to_bytes()
    with pytest.raises(CredentialError, match="not signed by the owner"):
        authority.verify(tampered, peer_id=ids["alice"])
    for garbage in (b"{", b"x" * 10_000, b'{"payload": 1, "signature": ""}'):
        with pytest.raises(CredentialError):
            authority.verify(garbage, peer_id=ids["alice"])


def test_issuing_refuses_bad_input_in_words(world):
    with pytest.raises(CredentialError, match="not a peer id"):
        issue(world[2]["open"], world[1]["open"], role="trainer", peer_id="nobody", valid_for_s=60)
    with pytest.raises(CredentialError, match="trainer or a peer"):
        _issue(world, role="owner")
    assert [parse_duration(t) for t in ("90", "90s", "30m", "12h", "7d")] == [90, 90, 1800, 43200, 604800]
    with pytest.raises(CredentialError, match="not a duration"):
        parse_duration("soon")


def test_files_round_trip_and_start_up_checks(world, tmp_path):
    root, runs, _, ids = world
    assert load_run(str(root / "open")) == runs["open"]  # the folder or the file
    assert load_run(str(root / "private" / "run.json")).private
    path = str(tmp_path / "alice.cred")
    write_credential(path, _issue(world))
    access = load_run_access(RunAccessConfig(run=str(root / "open"), credential=path), peer_id=ids["alice"])
    assert access.held.peer_id == ids["alice"] and access.credential == read_credential(path)
    with pytest.raises(RunFileError, match="--identity-path"):  # started with another identity
        load_run_access(RunAccessConfig(run=str(root / "open"), credential=path), peer_id=ids["mallory"])
    with pytest.raises(RunFileError, match="is a trainer credential; this process needs a peer"):  # given to a peer
        load_run_access(RunAccessConfig(run=str(root / "open"), credential=path), peer_id=ids["alice"], roles=("peer",))
    assert load_run_access(RunAccessConfig(), peer_id=ids["alice"]) is None
    with pytest.raises(RunFileError, match="no run with an owner"):  # a credential names a run it can find
        load_run_access(RunAccessConfig(credential=path), peer_id=ids["alice"])
    with pytest.raises(RunFileError, match="not a run file"):
        load_run(path)
    with pytest.raises(RunFileError, match="exists already"):
        create_run(str(root / "open"), private=False)


def _guard(authority):
    return AdmissionGuard(
        max_request_bytes=1 << 20, penalties=PenaltyBox(burst=100, refill_per_s=1), authority=authority
    )


def test_the_guard_applies_the_policy(world):
    _, runs, _, ids = world
    trainer = _issue(world).to_bytes().decode()
    peer = _issue(world, holder="mallory", role="peer", stage=0).to_bytes().decode()
    open_guard = _guard(RunAuthority(runs["open"]))
    open_guard.authorize(ids["alice"], trainer, "train")
    open_guard.authorize(ids["mallory"], None, "evaluate")  # an open run: anyone may evaluate...
    assert open_guard.refusal(ids["mallory"], needs_known_caller=True) is None  # ...and probe
    for credential in (None, peer):  # ...but only trainers change the weights
        with pytest.raises(NotAuthorizedError, match="not authorized"):
            open_guard.authorize(ids["mallory"], credential, "train")
    open_guard.authorize(ids["mallory"], peer, "state", stage=0)
    with pytest.raises(NotAuthorizedError):
        open_guard.authorize(ids["mallory"], peer, "state", stage=1)

    private_trainer = _issue(world, run="private").to_bytes().decode()
    private_guard = _guard(RunAuthority(runs["private"]))
    with pytest.raises(NotAuthorizedError):
        private_guard.authorize(ids["mallory"], None, "evaluate")
    assert isinstance(private_guard.refusal(ids["alice"], needs_known_caller=True), NotAuthorizedError)
    private_guard.authorize(ids["alice"], private_trainer, "evaluate")
    assert private_guard.refusal(ids["alice"], needs_known_caller=True) is None  # known now
    assert private_guard.refusal(ids["mallory"], needs_known_caller=True) is not None
    private_guard.recognize([ids["mallory"]], until=time.time() - 1)  # seen credentialed, but long ago
    assert private_guard.refusal(ids["mallory"], needs_known_caller=True) is not None
    private_guard.recognize([ids["mallory"]], until=time.time() + 60)  # a credentialed record, lately
    assert private_guard.refusal(ids["mallory"], needs_known_caller=True) is None
    no_authority = _guard(None)
    no_authority.authorize(ids["mallory"], None, "train")  # no run authority: as before


def test_averaging_members_are_the_records_with_a_peer_credential_for_the_stage(world):
    _, runs, _, ids = world
    authority = RunAuthority(runs["open"])

    def record(holder: str, credential: str | None) -> PeerRecord:
        return PeerRecord(
            peer_id=ids[holder],
            model="tiny",
            stage=0,
            num_stages=2,
            state=PeerState.ONLINE,
            throughput=1.0,
            expires_at=0.0,
            credential=credential,
        )

    alice_peer = _issue(world, role="peer", stage=0).to_bytes().decode()
    records = [record("alice", alice_peer), record("mallory", None)]
    assert credentialed_members(records, authority, stage=0) == {ids["alice"]}
    assert credentialed_members(records, authority, stage=1) == frozenset()  # issued for stage 0
    borrowed = [record("mallory", alice_peer)]  # alice's credential in mallory's own record
    assert credentialed_members(borrowed, authority, stage=0) == frozenset()
    trainer = [record("alice", _issue(world).to_bytes().decode())]  # trainers do not average
    assert credentialed_members(trainer, authority, stage=0) == frozenset()


def test_a_weight_is_capped_at_what_the_trainer_saw_served():
    assert capped_weight(1e12, 8) == 8
    assert capped_weight(3, 8) == 3
    assert capped_weight(1e12, None) == 1e12  # no caps given: hivemind's own weights
    assert 0 < capped_weight(5, 0) < 1e-6  # a replica that served nothing weighs (almost) nothing


def test_where_the_trainer_counted_nothing_no_member_weighs_more_than_the_groups_median():
    assert median_weight([1.0, 1.0, 1e6]) == 1.0  # the liar of a periodic round weighs what the others do
    assert median_weight([1.0, 1e6]) == 1.0  # a pair: the lower of the two
    assert median_weight([2.0, 4.0, 1.0, 8.0]) == 2.0
    assert median_weight([1.0, float("nan"), float("inf"), -5, "x", None]) < 1e-6  # garbage weighs nothing


def test_the_declared_weights_are_read_from_what_matchmaking_gathered(tmp_path):
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.p2p import PeerID
    from hivemind.utils import MSGPackSerializer as serializer

    def gathered(weight) -> bytes:
        return serializer.dumps([1.0, 0, serializer.dumps(weight)])

    for name in "abc":
        new_identity_file(str(tmp_path / name))
    ids = tuple(PeerID.from_base58(load_identity(str(tmp_path / name)).peer_id) for name in "abc")
    group = GroupInfo(b"g", ids, (gathered(1.0), gathered(1e6), b"garbage"))
    assert declared_weights(group, serializer) == [1.0, 1e6, None]
    assert median_weight(declared_weights(group, serializer)) == 1.0


def test_the_owners_own_process_issues_itself_a_credential_and_a_stranger_gets_none(world, tmp_path):
    """`--run` naming the run's folder (the owner key inside): the process is the owner's and needs no
    `swarm run issue` (every local swarm's processes start so, swarm/local_swarm.py); the public file
    alone, elsewhere, gives no credential."""
    root, _, _, ids = world
    access = load_run_access(RunAccessConfig(run=str(root / "open")), peer_id=ids["alice"], roles=("peer",))
    assert access.held.role == "peer" and access.held.peer_id == ids["alice"] and access.held.stage is None
    assert access.authority.verify(access.credential, peer_id=ids["alice"], roles=("peer",))
    trainer = load_run_access(RunAccessConfig(run=str(root / "open" / "run.json")), peer_id=ids["alice"])
    assert trainer.held.role == "trainer"  # roles[0] of ROLES
    (tmp_path / "public").mkdir()
    (tmp_path / "public" / "run.json").write_text((root / "open" / "run.json").read_text())
    stranger = load_run_access(RunAccessConfig(run=str(tmp_path / "public" / "run.json")), peer_id=ids["mallory"])
    assert stranger.credential is None and stranger.held is None


def test_run_issue_makes_the_holders_identity_file_when_there_is_none(tmp_path, capsys):
    """Issue #57: `swarm run issue --holder-identity peer.key` needed a key that no command made."""
    create_run(str(tmp_path / "run"), private=False)
    key, out = tmp_path / "peer0.key", tmp_path / "peer0.cred"
    config = RunIssueConfig(run_dir=str(tmp_path / "run"), role="peer", holder_identity=str(key), out=str(out))
    assert run_issue(config) == 0
    made = load_identity(str(key)).peer_id
    assert f"made the identity file {key} (peer {made})" in capsys.readouterr().out
    authority = RunAuthority(load_run(str(tmp_path / "run")))
    assert authority.verify(read_credential(str(out)), peer_id=made, roles=("peer",)) is not None
    # a second credential for the same holder reads the file it made, never replaces it
    again = RunIssueConfig(run_dir=str(tmp_path / "run"), role="peer", holder_identity=str(key), out=str(out) + "2")
    assert run_issue(again) == 0 and load_identity(str(key)).peer_id == made
    assert "made the identity file" not in capsys.readouterr().out
