"""Training on a user's corpus: text and jsonl files prepared with a BPE tokenizer, a 2-stage x
2-replica loopback swarm serving that vocabulary, the validation loss measured through the swarm
falling; a trainer and a peer with another vocabulary are refused in one line."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from swarm.data.prepare import PrepareConfig, prepare
from swarm.data.shards import read_meta
from swarm.trainer.data import shakespeare_files

pytestmark = pytest.mark.slow


def user_corpus(folder) -> str:
    """Three text files in a nested folder and a jsonl file of paragraphs (with two bad lines)."""
    texts = shakespeare_files()
    os.makedirs(folder / "plays" / "more")
    for i, path in enumerate(texts[:3]):
        shutil.copy(path, folder / "plays" / ("more" if i else "") / os.path.basename(path))
    with open(texts[3], encoding="utf-8", errors="replace") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    with open(folder / "notes.jsonl", "w") as f:
        f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs)
        f.write("not json\n" + json.dumps({"title": "no text"}) + "\n")
    return str(folder)


def test_a_swarm_trains_on_a_prepared_corpus_and_the_validation_loss_falls(make_swarm, tmp_path):
    data = str(tmp_path / "data")
    meta = prepare(
        PrepareConfig(inputs=[user_corpus(tmp_path / "corpus")], out=data, tokenizer="bpe:2048"), say=lambda _: None
    )
    assert meta.bad_lines == 2 and meta.splits["val"].documents > 0 and read_meta(data).vocab_size == meta.vocab_size
    swarm = make_swarm(
        num_stages=2,
        peer_args=["--vocab-size", str(meta.vocab_size), "--lr", "3e-3"],
        env={"SWARM_DATA_CACHE": str(tmp_path / "cache")},
    )
    swarm.start_bootstrap()
    peers = [swarm.start_peer(stage) for stage in (0, 0, 1, 1)]
    swarm.wait_online(peers)
    report_path = tmp_path / "report.json"
    trainer = swarm.start_trainer(
        "--num-stages", "2", "--data", data, "--steps", "12", "--batch-size", "16", "--microbatch-size", "4",
        "--eval-every", "6", "--eval-batches", "2", "--report", str(report_path),
    )  # fmt: skip
    assert trainer.popen.wait(timeout=400) == 0, trainer.log()[-3000:]
    report = json.loads(report_path.read_text())
    steps = [step for step, _ in report["eval_losses"]]
    losses = [loss for _, loss in report["eval_losses"]]
    assert steps == [0, 6, 12] and report["final_eval_loss"] == losses[-1]
    assert losses[-1] < losses[0], report["eval_losses"]
    assert report["vocab_size"] == meta.vocab_size and "validation loss" in trainer.log()

    # `swarm eval`: the same validation batches once, on what the swarm holds now (trained: lower).
    evaluation = swarm._spawn(
        "eval",
        ["eval", "--initial-peers", *swarm.initial_peers, "--model", "tiny", "--data", data, "--batches", "2",
         "--batch-size", "16"],
    )  # fmt: skip
    assert evaluation.popen.wait(timeout=200) == 0, evaluation.log()[-3000:]
    measured = float(re.search(r"validation loss (\d+\.\d+)", evaluation.log()).group(1))
    assert measured < losses[0], (measured, report["eval_losses"])

    # A trainer with byte-level data: refused in one line naming both vocabularies.
    text = tmp_path / "plain.txt"
    text.write_text(open(shakespeare_files()[5], encoding="utf-8", errors="replace").read())
    other = swarm.start_trainer("--num-stages", "2", "--data", str(text), "--steps", "2", name="bytes-trainer")
    assert other.popen.wait(timeout=200) == 2, other.log()[-3000:]
    error = [line for line in other.log().splitlines() if "error" in line]
    assert len(error) == 1 and str(meta.vocab_size) in error[0] and "256" in error[0], other.log()[-2000:]

    # A peer with another vocabulary: refused in one line, the swarm untouched.
    stray = swarm.start_peer(0, "--vocab-size", "256", name="stray")
    assert stray.popen.wait(timeout=200) == 2, stray.log()[-3000:]
    error = [line for line in stray.log().splitlines() if "error" in line]
    assert len(error) == 1 and str(meta.vocab_size) in error[0] and "256" in error[0], stray.log()[-2000:]
    assert all(peer.alive for peer in peers)
