"""The run spec (peers/run_spec.py, dht/run_specs.py, peers/settle.py): a typed, signed record of what a
run's processes agree on; which run a process joins; a peer's flags held to it."""

from __future__ import annotations

import json

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from dht.run_specs import SignedSpec, SpecAnnouncement, SpecError, known_runs, run_in_force, sign_spec, vouching_peers
from peers.config import PeerConfig
from peers.run_spec import RunSpec, find_run_spec, parse_spec, spec_options, spec_payload
from peers.settle import SpecConflictError, settle
from process.config import ConfigError
from swarm.run_authority import spec_file_options

CPU = torch.device("cpu")


def settled(config: PeerConfig, given=("model",), spec=None, created_at=1.0):
    return settle(config, set(given), spec, device=CPU, available_bytes=1 << 40, created_at=created_at)


def own_spec(**options) -> RunSpec:
    return settled(PeerConfig(model="tiny", **options)).spec


@pytest.fixture(scope="module")
def keys():
    return RSAPrivateKey(), RSAPrivateKey()


def test_a_first_peers_settings_make_a_spec_that_round_trips_signed(keys):
    spec = own_spec(num_stages=2, optim=PeerConfig().optim.__class__(lr=0.002, warmup_steps=3))
    assert (spec.model, spec.run_id, spec.version, spec.owned) == ("tiny", "tiny", 1, False)
    assert spec.split.boundaries == (0, 2, 3) and spec.optim.lr == 0.002 and spec.optim.warmup_steps == 3
    assert spec.replicas.averaging == "auto" and "load_state" not in spec.replicas.model_fields
    signed = sign_spec(keys[0], spec_payload(spec))
    assert signed.signed_by_key() and parse_spec(signed) == spec
    tampered = signed.model_copy(update={"payload": signed.payload.replace('"lr":0.002', '"lr":0.02')})
    assert not tampered.signed_by_key()
    forged = signed.model_copy(update={"signer_key": keys[1].get_public_key().to_bytes().decode()})
    assert not forged.signed_by_key()


def test_a_spec_with_an_unknown_key_or_a_bad_value_is_refused_in_one_line(keys):
    payload = json.loads(spec_payload(own_spec()))
    for change, words in (
        ({"optim": {**payload["optim"], "learning_rate": 1.0}}, "optim.learning_rate: Extra inputs"),
        ({"optim": {**payload["optim"], "lr": "fast"}}, "optim.lr"),
        ({"optim": {**payload["optim"], "optimizer": "adam"}}, "optim.optimizer"),
        ({"split": {"num_stages": 2, "boundaries": [0, 3, 3]}}, "do not describe 2 non-empty stages"),
        ({"split": {"num_stages": 2, "boundaries": [0, 1, 2]}}, "does not cover the model's 3 blocks"),
        ({"surprise": 1}, "surprise"),
    ):
        signed = sign_spec(keys[0], json.dumps({**payload, **change}))
        with pytest.raises(SpecError) as refused:
            parse_spec(signed)
        assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_later_version_changes_the_schedule_from_its_step_and_nothing_else():
    spec = own_spec()
    later = spec.with_change(from_step=10, lr=5e-4)
    assert later.version == 2 and later.follows(spec) and not spec.follows(later)
    rates = [later.schedule().rate(step) for step in (0, 9, 10, 50)]
    assert rates == [1e-3, 1e-3, 5e-4, 5e-4]
    assert spec.schedule().rate(50) == later.schedule(version=1).rate(50) == 1e-3
    assert later.schedule().in_force_from(10) == 10 and later.schedule().in_force_from(9) == 0
    third = later.with_change(from_step=20, warmup_steps=40)  # lr kept from version 2, warmup counted from step 0
    assert third.schedule().rate(20) == pytest.approx(5e-4 * 21 / 40)
    with pytest.raises(ValueError, match="after it, not at step 10"):
        later.with_change(from_step=10, lr=1e-4)
    with pytest.raises(ValueError, match="only the learning-rate schedule"):
        spec.with_change(from_step=5, optimizer="sgd")
    other = spec.model_copy(update={"optim": spec.optim.model_copy(update={"optimizer": "sgd"})})
    assert not other.with_change(from_step=10, lr=5e-4).follows(spec)


def announced(spec: RunSpec, key, *peers: str, payload: str | None = None) -> list[SpecAnnouncement]:
    signed = sign_spec(key, payload or spec_payload(spec))
    return [SpecAnnouncement(peer_id=peer, spec=signed, expires_at=1e12) for peer in peers]


def test_which_run_a_process_joins(keys):
    first, second = keys
    older, newer = own_spec(), settled(PeerConfig(model="tiny", seed=1), created_at=2.0).spec
    runs = known_runs([*announced(older, first, "a", "b"), *announced(newer, second, "c")])
    assert len(runs) == 2
    # two first peers of one model raced: the earlier claim wins, for everyone
    assert run_in_force(runs).spec.signer_key == first.get_public_key().to_bytes().decode()
    assert run_in_force(runs, vouching={"c"}).header.created_at == 2.0  # what the initial peers announce wins
    assert run_in_force(runs, model="small") is None
    # a run with an owner beside one without: refused, naming both
    owned = older.model_copy(update={"owned": True, "run_id": "mine"})
    runs = known_runs([*announced(owned, first, "a"), *announced(newer, second, "c")])
    with pytest.raises(SpecError) as refused:
        run_in_force(runs)
    assert "2 runs" in str(refused.value) and "'mine'" in str(refused.value) and "--run" in str(refused.value)
    assert run_in_force(runs, run_id="mine", owner_key=first.get_public_key().to_bytes().decode()).header.owned
    assert run_in_force(runs, owner_key=second.get_public_key().to_bytes().decode()) is None  # not the owner's
    # the highest version of a run counts; a forged signature does not count at all
    later = owned.with_change(from_step=5, lr=1e-4)
    forged = [
        a.model_copy(update={"spec": a.spec.model_copy(update={"signature": "x" * 40})})
        for a in announced(later, first, "z")
    ]
    runs = known_runs([*announced(owned, first, "a"), *announced(later, first, "b"), *forged])
    assert [r.header.version for r in runs] == [2] and runs[0].announcers == {"a", "b"}  # who announces the run
    assert vouching_peers(["/ip4/1.2.3.4/tcp/1/p2p/QmAbc", "/ip4/1.2.3.4/tcp/2"]) == {"QmAbc"}


def test_the_spec_a_peer_or_trainer_joins_is_its_runs_else_its_owner_folders_else_its_peers_settings(keys, tmp_path):
    """One rule for peers and trainers (`find_run_spec`): with --run, the run's own spec on the DHT;
    without one there, the spec in the owner's folder; without that either, the unowned spec the run's
    first peer signed (the trainer missed this one, and trained on its own flags)."""
    from dht.authority import RunAccessConfig, create_run, load_owner_key

    first, _ = keys
    peers_settings = announced(own_spec(), first, "a")
    unowned = known_runs(peers_settings)
    run = create_run(str(tmp_path / "run"), private=False, run_id="mine")
    public = str(tmp_path / "run" / "run.json")
    for given in (public, str(tmp_path / "run")):  # the public file, or the owner's folder (no spec in it)
        found = find_run_spec(unowned, RunAccessConfig(run=given), model=None, initial_peers=[])
        assert found is not None and found.digest == unowned[0].spec.digest
    assert find_run_spec([], RunAccessConfig(run=public), model=None, initial_peers=[]) is None
    assert find_run_spec(unowned, RunAccessConfig(run=public), model="small", initial_peers=[]) is None
    assert find_run_spec(unowned, RunAccessConfig(), model=None, initial_peers=[]) is not None  # no run: as before
    owner_key = load_owner_key(str(tmp_path / "run"), run)
    owned = own_spec().model_copy(update={"owned": True, "run_id": "mine"})
    runs = known_runs([*announced(owned, owner_key, "b"), *peers_settings])  # the run's own spec wins over the peers'
    found = find_run_spec(runs, RunAccessConfig(run=public), model=None, initial_peers=[])
    assert parse_spec(found).owned and parse_spec(found).run_id == "mine"


def test_a_flag_that_contradicts_the_spec_is_refused_naming_both_values():
    spec = own_spec()
    config = PeerConfig(model="tiny", optim=PeerConfig().optim.__class__(lr=0.02, optimizer="sgd"))
    with pytest.raises(SpecConflictError) as refused:
        settled(config, given={"lr", "optimizer"}, spec=spec)
    message = str(refused.value)
    assert "--lr 0.02 (the run's: 0.001)" in message and "--optimizer sgd (the run's: adamw)" in message
    assert "\n" not in message
    # the same values given explicitly are no contradiction; what is not given comes from the spec
    later = PeerConfig(model="tiny", num_stages=5, seed=3)
    effective = settled(later, given={"model"}, spec=spec).config
    assert (effective.num_stages, effective.seed, effective.split_boundaries) == (2, 0, "0,2,3")
    assert settled(PeerConfig(model="tiny", num_stages=2), given={"model", "num_stages"}, spec=spec)
    with pytest.raises(SpecConflictError, match="--split-boundaries 0,1,3"):
        settled(PeerConfig(model="tiny", split_boundaries="0,1,3"), given={"split_boundaries"}, spec=spec)


def test_a_spec_the_peer_cannot_satisfy_or_no_spec_at_all_is_one_line():
    spec = own_spec()
    folder = spec.model_copy(update={"source": spec.source.model_copy(update={"kind": "folder"})})
    with pytest.raises(SpecError, match="--model-dir DIR"):
        settled(PeerConfig(), given=(), spec=folder)
    with pytest.raises(SpecError, match="no run to join"):
        settled(PeerConfig(), given=(), spec=None)
    weights = spec.model_copy(update={"source": spec.source.model_copy(update={"init_weights_sha256": "ab" * 16})})
    with pytest.raises(SpecError, match="--init-weights FILE"):
        settled(PeerConfig(), given=(), spec=weights)
    with pytest.raises(ValueError, match="stage"):
        settled(PeerConfig(stage=4), given=("stage",), spec=spec)


def test_spec_options_are_peer_options():
    options = spec_options(own_spec())
    from process.config import option_values

    assert set(options) <= set(option_values(PeerConfig()))


def test_a_spec_file_with_an_unknown_key_table_or_type_is_refused_in_one_line(tmp_path):
    good = tmp_path / "run.toml"
    good.write_text('[source]\nmodel = "tiny"\nnum_stages = 2\n[optim]\nlr = 3e-4\n[replicas]\naveraging = "sync"\n')
    assert spec_file_options(str(good)) == {"model": "tiny", "num_stages": 2, "lr": 3e-4, "averaging": "sync"}
    for text, words in (
        ("[optim]\nlearning_rate = 1\n", "[optim] has no option 'learning_rate'"),
        ("[optimizer]\nlr = 1\n", "[optimizer] is not a table"),
        ('[optim]\nlr = "fast"\n', "[optim] lr"),
        ('[optim]\noptimizer = "adam"\n', "[optim] optimizer"),
        ("[optim\n", "not TOML"),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError) as refused:
            spec_file_options(str(bad))
        assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_signed_specs_fit_the_dht_value_cap():
    signed = SignedSpec(payload=spec_payload(own_spec()), signature="x" * 344, signer_key="y" * 400)
    assert len(json.dumps(signed.model_dump())) < 8 << 10


def test_a_trainer_takes_the_spec_and_is_refused_a_contradicting_flag(keys, tmp_path):
    from types import SimpleNamespace

    from swarm.trainer.config import TrainerConfig
    from swarm.trainer.settle import settle_trainer

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    data = SimpleNamespace(vocab_size=256, folder=str(tmp_path), tokenizer_path=str(tokenizer))
    signed = sign_spec(
        keys[0], spec_payload(own_spec(num_stages=2, optim=PeerConfig().optim.__class__(target_batch_size=16)))
    )
    trainer = settle_trainer(TrainerConfig(), set(), signed, data)
    assert (trainer.config.model, trainer.config.num_stages, trainer.config.schedule.batch_size) == ("tiny", 2, 16)
    assert settle_trainer(TrainerConfig(), {"batch_size"}, signed, data).config.schedule.batch_size == 32
    with pytest.raises(SpecConflictError, match=r"--num-stages 3 \(the run's: 2\)"):
        settle_trainer(TrainerConfig(num_stages=3), {"num_stages"}, signed, data)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        settle_trainer(TrainerConfig(), set(), signed, SimpleNamespace(**{**vars(data), "vocab_size": 300}))


def test_an_owners_spec_takes_its_flags_over_its_file(tmp_path):
    from process.config import from_sources, given_options
    from swarm.cli import build_parser
    from swarm.run_authority import RunCreateConfig, owner_spec

    spec_file = tmp_path / "run.toml"
    spec_file.write_text(
        '[source]\nmodel = "tiny"\nnum_stages = 3\n[optim]\nlr = 3e-4\nwarmup_steps = 10\n'
        '[replicas]\naveraging = "periodic"\naveraging_every_steps = 2\n[compression]\ncodec = "int8"\n'
    )
    args = build_parser().parse_args(
        ["run", "create", "--out", str(tmp_path / "run"), "--spec", str(spec_file), "--lr", "5e-4"]
    )
    spec = owner_spec(from_sources(RunCreateConfig, args, env={}), given_options(RunCreateConfig, args, env={}))
    assert spec.owned and spec.model == "tiny" and spec.split.boundaries == (0, 1, 2, 3)
    assert (spec.optim.lr, spec.optim.warmup_steps) == (5e-4, 10)  # the flag over the file
    assert (spec.replicas.averaging, spec.replicas.averaging_every_steps, spec.codec.codec) == ("periodic", 2, "int8")
