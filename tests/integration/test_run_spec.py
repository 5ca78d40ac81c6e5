"""Joining a run with one line (issue #58), on real processes: the run's spec says what to train.

- a run's owner creates it with a spec (`swarm run create --initial-peers`); peers started with only
  `--initial-peers` join, choose their stages and serve a trainer started with only `--initial-peers`;
- a peer that passes another --lr or --optimizer is refused in one line naming both values;
- a new version with another learning rate from step N is followed by every replica at step N;
- in a swarm started from flags (no owner), the first peer's settings are the spec: the --lr 0.02
  peer of the issue is refused instead of training another model beside its partner;
- bad input: one line, nothing written (a spec file with an unknown key, a missing model, a bad
  signature, a version for a past step, another tokenizer).
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from dht.announce import fetch_stage_records
from dht.node import NetworkConfig, start_dht
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from tests.hf_models import make_hf_folder
from tests.integration.polling import wait_for
from tests.integration.processes import stop_together

pytestmark = pytest.mark.slow

TRAIN = ("--batch-size", "8", "--microbatch-size", "2")


def one_line_refusal(process, *fragments: str, timeout_s: float = 120) -> str:
    """The one error line a process that exits 2 printed (and nothing of a traceback)."""
    assert process.popen.wait(timeout=timeout_s) == 2, process.log()[-3000:]
    log = process.log()
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def train(swarm, tmp_path, name: str, *args: str, named: bool = False) -> dict:
    report = tmp_path / f"{name}.json"
    trainer = swarm.start_trainer(*TRAIN, "--report", str(report), *args, name=name, named=named)
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    return json.loads(report.read_text())


def stage_params(folder, stage: int) -> dict[str, torch.Tensor]:
    return load_checkpoint(checkpoint_path(str(folder), "tiny", stage, 2))[1]


def test_a_run_created_with_a_spec_is_joined_with_one_line(make_swarm, tmp_path, swarm_cli):
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    run = tmp_path / "run"
    created = swarm_cli(
        "run", "create", "--out", str(run), "--model", "tiny", "--num-stages", "2", "--lr", "0.003",
        "--warmup-steps", "2", "--initial-peers", *swarm.initial_peers,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert "published run" in created.stdout and (run / "spec.json").is_file()
    first = swarm.start_volunteer()
    swarm.wait_online([first])
    second = swarm.start_volunteer()
    swarm.wait_online([second])
    stages = sorted(int(re.search(r"auto: joining stage (\d)", p.log()).group(1)) for p in (first, second))
    assert stages == [0, 1], (first.log()[-2000:], second.log()[-2000:])  # each took the stage that needed it
    for peer in (first, second):
        assert "lr 0.003, warmup 2 steps" in peer.log() and "signed by its owner" in peer.log()

    # the run's owner trains it (its folder: the trainer issues itself a credential); it takes the spec too
    report = train(swarm, tmp_path, "trainer", "--steps", "3", "--run", str(run), named=False)
    assert report["model"] == "tiny" and report["steps"] == 3 and report["microbatches_lost"] == 0
    trainer_log = next(p for p in swarm.processes if p.name == "trainer").log()
    assert "lr 0.003, warmup 2 steps" in trainer_log and "signed by its owner" in trainer_log, trainer_log[-3000:]

    lr = swarm.start_volunteer("--lr", "0.02", name="peer-v-lr")
    one_line_refusal(lr, "--lr 0.02 (the run's: 0.003)")
    optimizer = swarm.start_volunteer("--optimizer", "sgd", "--stage", "0", name="peer-v-sgd")
    one_line_refusal(optimizer, "--optimizer sgd (the run's: adamw)")
    out_of_range = swarm.start_volunteer("--stage", "5", name="peer-v-stage")
    one_line_refusal(out_of_range, "stage 5 is out of range")
    assert first.alive and second.alive


def test_a_new_version_is_followed_by_every_replica_at_its_step(make_swarm, tmp_path, swarm_cli):
    """The run's bootstrap node announces its spec (`swarm dht --run`); a version from step 4 with another
    learning rate is published while the run is at step 3, and every replica of both stages steps at the
    new rate from step 4, the stage-0 replicas to equal parameters."""
    run = tmp_path / "run"
    created = swarm_cli(
        "run", "create", "--out", str(run), "--model", "tiny", "--num-stages", "2", "--optimizer", "sgd", "--lr", "0.05"
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap(60.0, "--run", str(run))
    folders = {name: tmp_path / name for name in ("a", "b", "c")}
    # In a run with an owner, replicas average only with the run's members (issue #60): the owner's peers
    # (given its folder, each issues itself a credential), which take the spec like any peer.
    owners = ("--run", str(run))
    peers = [
        swarm.start_volunteer(*owners, "--stage", "0", "--checkpoint-dir", str(folders["a"])),
        swarm.start_volunteer(*owners, "--stage", "0", "--checkpoint-dir", str(folders["b"])),
        swarm.start_volunteer(*owners, "--stage", "1", "--checkpoint-dir", str(folders["c"])),
    ]
    swarm.wait_online(peers)
    train(swarm, tmp_path, "first", "--steps", "3", *owners, named=False)
    # `swarm run update` reads the run's step from the peers' records, renewed every few seconds
    reader = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
    try:
        wait_for(
            lambda: (
                min((r.steps_done for s in range(2) for r in fetch_stage_records(reader, "tiny", s)), default=0) >= 3
            ),
            timeout_s=60,
            what="every replica announcing its 3 steps",
        )
    finally:
        reader.shutdown()

    kept = (run / "spec.json").read_text()
    past = swarm_cli("run", "update", "--run-dir", str(run), "--from-step", "1", "--lr", "0.01",
                     "--initial-peers", *swarm.initial_peers)  # fmt: skip
    assert past.returncode == 2 and "a past step: run" in past.stderr and "at step 3" in past.stderr, past.stderr
    assert len([line for line in past.stderr.splitlines() if "error:" in line]) == 1
    assert (run / "spec.json").read_text() == kept  # nothing written
    update = swarm_cli("run", "update", "--run-dir", str(run), "--from-step", "4", "--lr", "0.01",
                       "--initial-peers", *swarm.initial_peers)  # fmt: skip
    assert update.returncode == 0 and "version 2: lr 0.01 from step 4" in update.stdout, update.stderr

    report = train(swarm, tmp_path, "second", "--steps", "3", *owners, named=False)
    assert report["microbatches_lost"] == 0
    for peer in peers:  # every replica of every stage steps at 0.01 from step 4 on, and not before
        said = "step 4 at learning rate 0.01 (the schedule of step 4 on)"
        wait_for(lambda: said in peer.log(), timeout_s=30, what=f"{peer.name}: {said}")
        assert "learning rate 0.01" not in peer.log().split("step 4 at learning rate 0.01")[0]
    stop_together(peers)
    a, b = stage_params(folders["a"], 0), stage_params(folders["b"], 0)
    assert a.keys() == b.keys()
    for name in a:  # sync replicas that stepped on one schedule hold the same parameters
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_a_swarm_with_no_owner_holds_later_peers_to_its_first_peers_settings(make_swarm, tmp_path):
    """The issue's measurement: a third peer joined stage 0 with --lr 0.02 beside its partner at 1e-3 and
    trained another model for 30 steps unnoticed. Now it is refused at start, and a peer given
    nothing but --initial-peers takes the first peer's settings."""
    swarm = make_swarm(num_stages=2, run=False)
    swarm.start_bootstrap()
    first, last = swarm.start_peer(0), swarm.start_peer(1)
    swarm.wait_online([first, last])
    assert "a swarm with no owner: its first peer's settings" in first.log()
    stray = swarm.start_peer(0, "--lr", "0.02", name="peer-s0-stray")
    one_line_refusal(stray, "--lr 0.02 (the run's: 0.001)", "run 'tiny'")
    sgd = swarm.start_peer(0, "--optimizer", "sgd", name="peer-s0-sgd")
    one_line_refusal(sgd, "--optimizer sgd (the run's: adamw)")
    joined = swarm.start_volunteer("--stage", "0")
    swarm.wait_online([joined])
    assert "lr 0.001" in joined.log() and "run tiny version 1" in joined.log()
    report = train(swarm, tmp_path, "trainer", "--steps", "2", named=True)
    assert report["microbatches_lost"] == 0


def test_two_first_peers_that_race_agree_on_one_run(make_swarm):
    swarm = make_swarm(num_stages=2, run=False)
    swarm.start_bootstrap()
    racing = [swarm.start_peer(0, "--lr", "0.001"), swarm.start_peer(1, "--lr", "0.002")]
    outcome = {}
    wait_for(
        lambda: all(" online:" in p.log() or p.popen.poll() is not None for p in racing),
        timeout_s=120,
        what="each racing peer online or refused",
    )
    for peer in racing:
        outcome[peer.name] = "online" if peer.alive else peer.popen.returncode
    assert sorted(map(str, outcome.values())) == ["2", "online"], {p.name: p.log()[-2000:] for p in racing}
    loser = next(p for p in racing if not p.alive)
    assert "contradict the spec of run 'tiny'" in loser.log()


def test_bad_specs_and_data_get_one_line_and_nothing_written(make_swarm, tmp_path, swarm_cli):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[optim]\nlearning_rate = 0.1\n")
    result = swarm_cli("run", "create", "--out", str(tmp_path / "r1"), "--spec", str(unknown))
    assert result.returncode == 2 and "[optim] has no option 'learning_rate'" in result.stderr
    assert not (tmp_path / "r1").exists()  # nothing written
    missing = swarm_cli("run", "create", "--out", str(tmp_path / "r2"), "--model", "nonexistent")
    assert missing.returncode == 2 and "unknown model 'nonexistent'" in missing.stderr
    assert not (tmp_path / "r2").exists()
    for text, words in (
        ('model = "nonexistent"', "unknown model 'nonexistent'"),
        ('model_dir = "/nope"', "no such folder"),
    ):
        spec_file = tmp_path / "missing.toml"
        spec_file.write_text(f"[source]\n{text}\n")
        result = swarm_cli("run", "create", "--out", str(tmp_path / "r3"), "--spec", str(spec_file))
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert len([line for line in result.stderr.splitlines() if "error:" in line]) == 1
        assert not (tmp_path / "r3").exists()

    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    # a spec in the run's folder that its owner did not sign: a peer given the folder refuses it
    run = tmp_path / "run"
    assert swarm_cli("run", "create", "--out", str(run), "--model", "tiny").returncode == 0
    signed = json.loads((run / "spec.json").read_text())
    signed["payload"] = signed["payload"].replace('"lr":0.001', '"lr":0.5')
    (run / "spec.json").write_text(json.dumps(signed))
    forged = swarm.start_volunteer("--run", str(run), "--checkpoint-dir", str(tmp_path / "kept"), name="peer-v-forged")
    one_line_refusal(forged, "not signed by the owner")
    assert not (tmp_path / "kept").exists()  # nothing written
    # ... nor does its owner publish a version of it: one line, and spec.json is left as it was
    kept = (run / "spec.json").read_text()
    update = swarm_cli("run", "update", "--run-dir", str(run), "--from-step", "5", "--lr", "0.01",
                       "--initial-peers", *swarm.initial_peers)  # fmt: skip
    assert update.returncode == 2 and "not signed by the owner" in update.stderr, update.stderr
    assert len([line for line in update.stderr.splitlines() if "error:" in line]) == 1
    assert (run / "spec.json").read_text() == kept
    # a run whose model is a Hugging Face folder: a peer without it is refused in one line
    folder = tmp_path / "gpt2-folder"
    make_hf_folder(folder, "gpt2")
    made = swarm_cli("run", "create", "--out", str(tmp_path / "hf"), "--model-dir", str(folder),
                     "--initial-peers", *swarm.initial_peers)  # fmt: skip
    assert made.returncode == 0, made.stderr
    no_folder = swarm.start_volunteer("--run", str(tmp_path / "hf"), name="peer-v-nofolder")
    one_line_refusal(no_folder, "start this peer with --model-dir DIR")


def test_a_trainer_checks_its_datas_tokenizer_against_the_spec(make_swarm, tmp_path, swarm_cli):
    for seed, name in enumerate("ab"):  # two corpora of made-up words: two BPEs of one size, other merges
        rng = random.Random(seed)
        words = [
            "".join(rng.choice("abcdefghijklmnop"[seed * 4 :]) for _ in range(rng.randint(2, 7))) for _ in range(400)
        ]
        (tmp_path / f"{name}.txt").write_text(" ".join(rng.choice(words) for _ in range(30_000)))
        made = swarm_cli("data", "prepare", str(tmp_path / f"{name}.txt"), "--out", str(tmp_path / name),
                         "--tokenizer", "bpe:300")  # fmt: skip
        assert made.returncode == 0, made.stderr
    vocab = {json.loads((tmp_path / name / "meta.json").read_text())["vocab_size"] for name in "ab"}
    assert len(vocab) == 1, vocab  # one vocabulary: only the tokenizers differ
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    run = tmp_path / "run"
    created = swarm_cli("run", "create", "--out", str(run), "--model", "tiny", "--tokenizer", str(tmp_path / "a"),
                        "--initial-peers", *swarm.initial_peers)  # fmt: skip
    assert created.returncode == 0 and f"vocabulary {vocab.pop()}" in created.stdout, created.stdout + created.stderr
    peers = [swarm.start_volunteer("--stage", "0"), swarm.start_volunteer("--stage", "1")]
    swarm.wait_online(peers)
    owners = ("--run", str(run))
    report = train(swarm, tmp_path, "right", "--steps", "1", "--data", str(tmp_path / "a"), *owners, named=False)
    assert report["steps"] == 1
    wrong = swarm.start_trainer(
        *TRAIN, "--steps", "1", "--data", str(tmp_path / "b"), *owners, name="wrong", named=False
    )
    one_line_refusal(wrong, "tokenized with another tokenizer", "swarm data prepare --tokenizer")
