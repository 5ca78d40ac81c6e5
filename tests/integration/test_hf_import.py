"""A swarm served from a Hugging Face model folder (--model-dir): before any step, the swarm's loss
on a batch equals transformers' on the same batch; after a few steps, the export reloads in
transformers with the loss `swarm eval` gives; a peer or a trainer of another model under the
same name is refused in one line; a bad folder stops a peer in one line."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F

from swarm.trainer.data import MicrobatchSampler, ValidationBatches, open_data
from tests.hf_models import make_hf_folder

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB, SEQ, BATCH, MICROBATCH = 256, 16, 4, 2  # the default corpus is bytes: the model must have their 256


def transformers_loss(model) -> float:
    sampler = MicrobatchSampler(open_data(None).train, seq_len=SEQ, batch_size=BATCH, microbatch_size=MICROBATCH)
    microbatches = sampler.batch(0)
    inputs = torch.cat([mb.inputs for mb in microbatches])
    targets = torch.cat([mb.targets for mb in microbatches])
    with torch.no_grad():
        logits = model(inputs).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).item()


def train_one_step(swarm, folder, report_path, name="trainer", steps: int = 1):
    return swarm.start_trainer(
        "--model-dir",
        folder,
        "--steps",
        str(steps),
        "--batch-size",
        str(BATCH),
        "--microbatch-size",
        str(MICROBATCH),
        "--num-stages",
        "2",
        "--report",
        report_path,
        "--discovery-timeout-s",
        "60",
        name=name,
    )


@pytest.mark.parametrize("kind", ["gpt2-tied", "llama", "llama-gqa-tied"])
def test_a_swarm_served_from_a_folder_computes_transformers_loss(make_swarm, tmp_path, kind, swarm_cli):
    folder = str(tmp_path / "model")
    reference = make_hf_folder(folder, kind, vocab=VOCAB, seq_len=SEQ)
    swarm = make_swarm(
        model="hf-test",
        num_stages=2,
        peer_args=["--model-dir", folder, "--optimizer", "sgd", "--lr", "0.1", "--target-batch-size", str(BATCH)],
    )
    swarm.start_bootstrap()
    peers = [swarm.start_peer(stage) for stage in range(2)]
    swarm.wait_online(peers)
    assert "loaded" in peers[1].log() and "from " + folder in peers[1].log()

    report_path = str(tmp_path / "report.json")
    trainer = train_one_step(swarm, folder, report_path, steps=3)
    assert trainer.popen.wait(timeout=180) == 0, trainer.log()
    with open(report_path) as f:
        report = json.load(f)
    assert report["losses"][0] == pytest.approx(transformers_loss(reference), abs=1e-4)  # before any step

    # Fine-tuned for 3 steps: the export reloads in transformers and computes what the swarm evaluates.
    exported = tmp_path / "exported"
    result = swarm_cli(
        "export", "--initial-peers", *swarm.initial_peers, "--model", "hf-test", "--model-dir", folder,
        "--out", str(exported), *swarm.run_args(),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    evaluated = tmp_path / "eval.json"
    result = swarm_cli(
        "eval", "--initial-peers", *swarm.initial_peers, "--model", "hf-test", "--model-dir", folder,
        "--batches", "2", "--batch-size", str(BATCH), "--microbatch-size", str(MICROBATCH), "--json-out", str(evaluated),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    batches = ValidationBatches(
        open_data(None).val, seq_len=SEQ, batch_size=BATCH, microbatch_size=MICROBATCH, count=2
    ).batches()
    inputs = torch.cat([mb.inputs for batch in batches for mb in batch])
    targets = torch.cat([mb.targets for batch in batches for mb in batch])
    with torch.no_grad():
        logits = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()(inputs).logits
        before = reference(inputs).logits
    exported_loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).item()
    assert exported_loss == pytest.approx(json.loads(evaluated.read_text())["eval_loss"], abs=1e-4)
    assert not torch.allclose(logits, before, atol=1e-3)  # the steps changed the model

    if kind != "gpt2-tied":
        return
    # Another model under the same name: the peer and the trainer are refused in one line.
    other = str(tmp_path / "other")
    make_hf_folder(other, "gpt2", vocab=VOCAB, seq_len=SEQ)  # exact GELU, untied: another fingerprint
    intruder = swarm.start_peer(1, "--model-dir", other, name="peer-intruder")
    assert intruder.popen.wait(timeout=120) != 0
    errors = [line for line in intruder.log().splitlines() if "error" in line]
    assert len(errors) == 1 and "differs from the one" in errors[0], intruder.log()
    trainer = train_one_step(swarm, other, str(tmp_path / "other.json"), name="trainer-other")
    assert trainer.popen.wait(timeout=120) != 0
    assert "differs from the one" in trainer.log(), trainer.log()
    assert "Traceback" not in trainer.log()


def test_a_bad_folder_stops_a_peer_in_one_line(tmp_path, swarm_cli, make_swarm):
    swarm = make_swarm(num_stages=2, run=False)  # a peer joins a running swarm before it reads the folder
    swarm.start_bootstrap()
    (tmp_path / "empty").mkdir()
    bad = {"config.json": {"model_type": "bert", "hidden_size": 32}}
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(bad["config.json"]))
    # each stops in one line; the bert folder has no weights either, and which check speaks first is the
    # folder reader's order (its weights since the run spec's model check)
    bert = ("model_type 'bert' is not supported", "has no model.safetensors")
    for folder, expected in [("empty", ("has no model.safetensors",)), ("bert", bert)]:
        result = swarm_cli(
            *("peer", "--model-dir", str(tmp_path / folder), "--stage", "0", "--initial-peers", *swarm.initial_peers),
            timeout=120,
        )
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and any(fragment in lines[0] for fragment in expected), result.stderr


def test_a_folder_with_its_own_tokenizer_is_fine_tuned_on_its_tokens(make_swarm, tmp_path, swarm_cli):
    """A folder with a tokenizer.json of 300 tokens: `swarm train --model-dir` without --data trains
    on the default corpus tokenized with it; `swarm demo --model-dir` given data of another tokenizer
    refuses in one line, before it starts any process."""
    from tokenizers import Tokenizer

    from swarm.data.tokenizer import train_bpe
    from swarm.trainer.data import shakespeare_files

    tokenizer = train_bpe([open(shakespeare_files()[0]).read()[:200_000]], 300)
    folder = str(tmp_path / "model")
    make_hf_folder(folder, "gpt2-tied", vocab=tokenizer.get_vocab_size(), seq_len=SEQ)
    tokenizer.save(f"{folder}/tokenizer.json")
    swarm = make_swarm(model="hf-tok", num_stages=2, peer_args=["--model-dir", folder])
    swarm.start_bootstrap()
    swarm.wait_online([swarm.start_peer(stage) for stage in range(2)])
    report_path = tmp_path / "report.json"
    trainer = train_one_step(swarm, folder, str(report_path), steps=2)
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    assert f"vocabulary {tokenizer.get_vocab_size()}" in trainer.log(), trainer.log()[-3000:]
    assert "mean of the last 2 steps" in trainer.log()
    prepared = glob.glob(os.path.join(os.environ["SWARM_CACHE_DIR"], "data", "shakespeare-file-*", "tokenizer.json"))
    assert [Tokenizer.from_file(path).get_vocab() == tokenizer.get_vocab() for path in prepared] == [True]

    demo = swarm_cli("demo", "--model-dir", folder, "--tokenizer", "bytes", "--peers", "2", "--steps", "1")
    assert demo.returncode == 2, demo.stdout[-2000:] + demo.stderr[-2000:]
    (line,) = demo.stderr.strip().splitlines()
    assert "not tokenized with the model's own tokenizer" in line and f"--tokenizer {folder}/tokenizer.json" in line
    assert "bootstrap" not in demo.stdout  # refused before any process started
