"""Where a process's model comes from (--model or --model-dir), and the refusal of peers of
another model under the same name."""

from __future__ import annotations

import pytest

from dht.authority import RunAuthority
from dht.model_match import ModelMismatchError, check_same_model, describe_foreign, foreign_records, judging_records
from dht.records import PeerRecord, PeerState
from models.config import get_model_config
from models.hf_format import ModelFolderError, write_model_folder
from models.model_source import DEFAULT_MODEL, model_hash, resolve_model
from models.stages import build_full_model


def record(peer_id: str, model_hash: str) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        model="m",
        stage=0,
        num_stages=2,
        state=PeerState.ONLINE,
        throughput=1.0,
        expires_at=100.0,
        model_hash=model_hash,
    )


def test_a_folder_gives_the_config_named_after_it_or_after_model(tmp_path):
    config = get_model_config("llama-tiny")
    folder = write_model_folder(config, build_full_model(config).state_dict(), str(tmp_path / "my-llama"))
    resolved = resolve_model(DEFAULT_MODEL, folder)
    assert resolved.name == "my-llama"
    assert resolve_model("shared-name", folder).name == "shared-name"
    # the same model, by name or from its folder, has one fingerprint
    assert model_hash(resolved) == model_hash(config)
    assert model_hash(resolved) != model_hash(get_model_config("tiny"))
    assert resolve_model("tiny") == get_model_config("tiny")
    with pytest.raises(ModelFolderError, match="not a model folder"):
        resolve_model(DEFAULT_MODEL, str(tmp_path))


def test_the_odd_one_out_is_refused_and_unstated_hashes_are_not_judged():
    records = [record("a", "h1"), record("b", ""), record("c", "h2")]
    assert [r.peer_id for r in foreign_records(records, "h1")] == ["c"]
    assert foreign_records(records, "") == []
    assert check_same_model(records[:2], "h1", model="m", who="peer") == []
    with pytest.raises(ModelMismatchError, match=r"differs from the one 1 live peer\(s\) serve \(hash h2\)"):
        check_same_model(records[1:], "h1", model="m", who="trainer")


def test_a_record_of_another_model_beside_the_swarms_own_is_skipped_not_obeyed():
    """Issue #60: one stranger's record of another fingerprint made every new trainer and peer exit."""
    records = [record("a", "h1"), record("stranger", "h2")]
    assert [r.peer_id for r in check_same_model(records, "h1", model="m", who="trainer")] == ["stranger"]
    assert "skipping 1 record(s) of 1 peer(s) that announce another model (hash h2" in describe_foreign(
        foreign_records(records, "h1")
    )


def test_in_a_run_only_credentialed_records_judge_a_credentialed_process(tmp_path):
    from dht.authority import create_run, issue, load_owner_key
    from dht.signing import load_identity, new_identity_file

    ids = {}
    for name in ("member", "stranger"):
        new_identity_file(str(tmp_path / f"{name}.key"))
        ids[name] = load_identity(str(tmp_path / f"{name}.key")).peer_id
    for private in (True, False):
        folder = str(tmp_path / f"run-{private}")
        run = create_run(folder, private=private)
        authority = RunAuthority(run)
        credential = issue(
            load_owner_key(folder, run), run, role="peer", peer_id=ids["member"], stage=0, valid_for_s=60
        )
        stranger = record(ids["stranger"], "h2")
        member = record(ids["member"], "h1").model_copy(update={"credential": credential.to_bytes().decode()})
        # alone on the DHT, the stranger's record is no judge of a credentialed process (private or open)
        assert check_same_model([stranger], "h1", model="m", who="peer", authority=authority, credentialed=True)
        assert judging_records([stranger, member], authority) == [member]
        if not private:  # an open run's process without a credential, with no member record to go by
            with pytest.raises(ModelMismatchError):
                check_same_model([stranger], "h1", model="m", who="peer", authority=authority)
        with pytest.raises(ModelMismatchError):  # a credentialed member of another model still refuses us
            check_same_model([member], "h3", model="m", who="peer", authority=authority, credentialed=True)
