"""Where a process's model comes from (--model or --model-dir), and the refusal of peers of
another model under the same name."""

from __future__ import annotations

import pytest

from dht.model_match import ModelMismatchError, check_same_model, foreign_records
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


def test_peers_of_another_model_are_refused_and_unstated_hashes_are_not_judged():
    records = [record("a", "h1"), record("b", ""), record("c", "h2")]
    assert [r.peer_id for r in foreign_records(records, "h1")] == ["c"]
    assert foreign_records(records, "") == []
    check_same_model(records[:2], "h1", model="m", who="peer")
    with pytest.raises(ModelMismatchError, match=r"differs from the one 1 live peer\(s\) serve \(hash h2\)"):
        check_same_model(records, "h1", model="m", who="trainer")
