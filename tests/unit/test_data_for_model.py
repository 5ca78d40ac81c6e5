"""Which data a trainer may drive a model on, and the lines a new user reads about it: a model
folder's own tokenizer is the default, data the folder cannot read is refused in one line that
says how to prepare it, a tiny validation split warns, and the trainer's last line says what its
loss figures are."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tokenizers import Tokenizer

from models.config import get_model_config
from models.hf_format import write_model_folder
from models.model_source import DEFAULT_MODEL, VocabularyError
from models.stages import build_full_model
from swarm.cli import done_line
from swarm.data.prepare import PrepareConfig, prepare
from swarm.data.shards import PreparedData
from swarm.data.tokenizer import train_bpe
from swarm.trainer.data import ValidationBatches, model_for_data, model_tokenizer, open_data
from swarm.trainer.run import TrainingReport

LINES = [f"ROMEO: line {i} of the play, and what the nurse said to him." for i in range(400)]
TEXT = "\n".join(LINES)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"  # one document per line: some go to the validation split
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in LINES))
    return str(path)


def folder_of(tmp_path, vocab: int, tokenizer: Tokenizer | None = None) -> str:
    config = dataclasses.replace(get_model_config("tiny"), vocab_size=vocab)
    folder = write_model_folder(config, build_full_model(config).state_dict(), str(tmp_path / f"model-{vocab}"))
    if tokenizer is not None:
        tokenizer.save(f"{folder}/tokenizer.json")
    return folder


def prepared(tmp_path, corpus: str, tokenizer: str, name: str) -> PreparedData:
    prepare(PrepareConfig(inputs=[corpus], out=str(tmp_path / name), tokenizer=tokenizer), say=lambda _: None)
    return PreparedData(str(tmp_path / name))


def test_a_folder_without_a_tokenizer_trains_on_bytes_whatever_its_vocabulary(tmp_path, corpus):
    folder = folder_of(tmp_path, 5000)
    assert model_tokenizer(folder) is None
    data = prepared(tmp_path, corpus, "bytes", "bytes")
    assert model_for_data(DEFAULT_MODEL, folder, data).vocab_size == 5000  # the folder's, not the data's
    assert model_for_data("tiny", None, data).vocab_size == 256  # a named model takes the data's


def test_a_folder_with_a_tokenizer_is_trained_on_data_made_with_it(tmp_path, corpus, monkeypatch):
    tokenizer = train_bpe([TEXT], 300)
    folder = folder_of(tmp_path, tokenizer.get_vocab_size(), tokenizer)
    assert model_tokenizer(folder) == f"{folder}/tokenizer.json"
    # the default corpus would be tokenized with it; here a text file stands in for it
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    data = open_data(corpus, tokenizer=model_tokenizer(folder), say=lambda _: None)
    assert data.vocab_size == tokenizer.get_vocab_size()
    assert Tokenizer.from_file(data.tokenizer_path).get_vocab() == tokenizer.get_vocab()
    assert "file-" in data.folder and "tokenizer.json" not in data.folder  # a cache name, not a path
    assert model_for_data(DEFAULT_MODEL, folder, data).vocab_size == tokenizer.get_vocab_size()

    other = prepared(tmp_path, corpus, "bpe:280", "other")  # fewer tokens, but another tokenizer's ids
    with pytest.raises(VocabularyError, match="not tokenized with the model's own tokenizer") as error:
        model_for_data(DEFAULT_MODEL, folder, other)
    assert f"--tokenizer {folder}/tokenizer.json" in str(error.value) and "\n" not in str(error.value)


def test_data_with_more_tokens_than_the_folder_has_is_refused_with_what_to_do(tmp_path, corpus):
    data = prepared(tmp_path, corpus, "bpe:400", "big")
    with pytest.raises(VocabularyError, match=r"vocabulary of \d+ tokens, more than the model in .* has \(300\)") as e:
        model_for_data(DEFAULT_MODEL, folder_of(tmp_path, 300), data)
    assert "--tokenizer bytes" in str(e.value)


def test_a_validation_split_smaller_than_the_batches_read_warns(tmp_path, corpus):
    data = prepared(tmp_path, corpus, "bytes", "bytes")
    small = ValidationBatches(data.val, seq_len=128, batch_size=32, microbatch_size=4, count=8)
    assert small.warning is not None and f"only {len(data.val):,} tokens" in small.warning
    assert "--val-fraction" in small.warning
    enough = ValidationBatches(data.val, seq_len=8, batch_size=4, microbatch_size=4, count=1)
    assert enough.warning is None


def test_the_trainers_last_line_says_its_final_loss_is_a_mean_of_the_last_steps():
    report = TrainingReport(
        model="small", num_stages=2, steps=150, losses=[8.4] + [6.0] * 149, initial_loss=8.4, final_loss=6.0
    )
    line = done_line(report)
    assert line.startswith("done: 150 steps, loss 8.4000 (first step) -> 6.0000 (mean of the last 5 steps)"), line
    one = TrainingReport(model="small", num_stages=2, steps=1, losses=[8.4], initial_loss=8.4, final_loss=8.4)
    assert "(the last step)" in done_line(one)
    assert "no loss yet" in done_line(TrainingReport(model="small", num_stages=2))


def test_the_demo_repeats_the_trainers_one_line_reason():
    from swarm.demo import failure_reason

    log = "metrics on http://127.0.0.1:1/metrics\nswarm train: error: the data in d has a vocabulary of 5,000 tokens\n"
    assert failure_reason(log) == "the data in d has a vocabulary of 5,000 tokens"
    assert failure_reason("step 1/2 loss 5.6\n") is None
