"""swarm data prepare and the prepared folder: documents, tokenizers, shards, windows, bad input."""

from __future__ import annotations

import gzip
import json
import os
import threading

import numpy as np
import pytest
import torch

from swarm.data import prepare as prepare_module
from swarm.data import shards
from swarm.data.prepare import PrepareConfig, goes_to_validation, prepare
from swarm.data.shards import PreparedData, ShardWriter, TokenSplit, read_meta
from swarm.data.sources import CorpusError, iter_documents, list_inputs, split_text
from swarm.data.tokenizer import TokenizerSpec, byte_tokenizer, token_dtype
from swarm.trainer.data import MicrobatchSampler, ValidationBatches

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex jolly bumpkins".split()


def text(seed: int, paragraphs: int = 20) -> str:
    rng = np.random.default_rng(seed)
    return "\n\n".join(" ".join(rng.choice(WORDS, size=40)) for _ in range(paragraphs))


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(text(1))
    (folder / "sub" / "b.md").write_text(text(2))
    (folder / ".hidden").write_text("never read")
    lines = [json.dumps({"text": text(3 + i, 2)}) for i in range(30)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines + ["{not json", json.dumps({"body": "no text field"})]))
    with gzip.open(tmp_path / "more.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"content": text(50 + i, 2)}) for i in range(10)))
    return tmp_path


def run(inputs, out, **kwargs) -> tuple:
    lines = []
    meta = prepare(PrepareConfig(inputs=[str(i) for i in inputs], out=str(out), **kwargs), say=lines.append)
    return meta, lines


def test_bytes_tokenizer_encodes_utf8_bytes_exactly():
    tokenizer = byte_tokenizer()
    sample = "Hello  wörld\n\n\tend ✓ <|endoftext|>"
    assert tokenizer.encode(sample).ids == list(sample.encode("utf-8"))
    assert tokenizer.decode(list(sample.encode("utf-8"))) == sample
    assert tokenizer.get_vocab_size() == 256


def test_token_dtype_is_the_smallest_that_holds_the_vocabulary():
    assert token_dtype(256) == np.uint8 and token_dtype(257) == np.uint16
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_text_files_split_into_documents_at_blank_lines():
    paragraphs = ["p" * 100] * 10
    documents = split_text("\n\n\n".join(paragraphs), max_chars=350)
    assert len(documents) == 4 and all(len(d) <= 350 for d in documents)
    assert "".join(documents).replace("\n", "") == "".join(paragraphs)


def test_inputs_are_read_recursively_and_bad_jsonl_lines_are_counted(corpus):
    files = list_inputs([str(corpus / "corpus"), str(corpus / "docs.jsonl")])
    assert [os.path.basename(f.path) for f in files] == ["a.txt", "b.md", "docs.jsonl"]  # no hidden file
    from swarm.data.sources import ReadStats

    stats = ReadStats()
    documents = list(iter_documents(files, stats=stats))
    assert stats.documents == len(documents) == 2 + 30
    assert stats.skipped_lines == {"not JSON": 1, "no 'text' text field": 1}


def test_prepare_with_bpe_writes_shards_meta_and_a_tokenizer(corpus, tmp_path):
    out = tmp_path / "data"
    meta, lines = run([corpus / "corpus", corpus / "docs.jsonl"], out, tokenizer="bpe:300", val_fraction=0.2)
    assert meta.vocab_size == 300 and meta.dtype == "uint16" and meta.documents == 32
    assert meta.skipped_lines == {"not JSON": 1, "no 'text' text field": 1}
    assert any("skipped jsonl lines" in line for line in lines)
    assert meta.splits["val"].documents >= 1 and meta.splits["train"].documents >= 1
    assert meta.splits["val"].documents + meta.splits["train"].documents == 32
    assert sorted(os.listdir(out)) == [
        "meta.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "train-00000.bin",
        "val-00000.bin",
    ]
    data = PreparedData(str(out))
    assert len(data.train) == meta.splits["train"].tokens and data.train.window(0, 5).dtype == np.int64
    assert int(np.max(data.train.window(0, len(data.train)))) < 300
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(data.tokenizer_path).get_vocab_size() == 300
    assert all(len(i.sha256) == 64 for i in meta.inputs)


def test_transformers_loads_the_prepared_tokenizer_with_its_end_of_text_token(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "data"
    run([corpus / "corpus"], out, tokenizer="bpe:300")
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id is not None
    assert loaded.decode(loaded("to be or not")["input_ids"]) == "to be or not"


def test_validation_is_held_out_by_document(corpus, tmp_path):
    meta, _ = run([corpus / "docs.jsonl"], tmp_path / "d", tokenizer="bytes", val_fraction=0.3)
    documents = list(iter_documents(list_inputs([str(corpus / "docs.jsonl")])))
    held_out = [d for d in documents if goes_to_validation(d, 0.3)]
    assert meta.splits["val"].documents == len(held_out) > 0
    # every held-out document's bytes (and its separator) are exactly the validation split
    expected = b"".join(d.encode() + b"\n\n" for d in held_out)
    data = PreparedData(str(tmp_path / "d"))
    assert bytes(data.val.window(0, len(data.val)).astype(np.uint8)) == expected


def test_at_least_one_document_is_held_out(tmp_path):
    (tmp_path / "two.txt").write_text("first document " * 10 + "\n\n" + "second one " * 10)
    meta, _ = run([tmp_path / "two.txt"], tmp_path / "d", tokenizer="bytes", val_fraction=0.01)
    # one text file holding two short paragraphs is one document: nothing to hold out then
    assert meta.documents == 1 and meta.splits["val"].documents == 0
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 20}) for i in range(3)))
    meta, _ = run([tmp_path / "docs.jsonl"], tmp_path / "e", tokenizer="bytes", val_fraction=0.01)
    assert meta.splits["val"].documents >= 1


def test_rerun_reuses_and_a_changed_input_is_prepared_again(corpus, tmp_path):
    out = tmp_path / "d"
    run([corpus / "corpus"], out, tokenizer="bytes")
    _, lines = run([corpus / "corpus"], out, tokenizer="bytes")
    assert any("reusing" in line for line in lines)
    (corpus / "corpus" / "a.txt").write_text(text(99))
    _, lines = run([corpus / "corpus"], out, tokenizer="bytes")
    assert not any("reusing" in line for line in lines)


def test_a_second_prepare_of_a_folder_being_prepared_waits_and_reuses_it(corpus, tmp_path, monkeypatch):
    """Two trainers started at once on one file: the second must not clear the folder the first
    is writing (or its readers have opened), so it waits for the first and reuses its work."""
    encode, first_encoding, release = prepare_module._encode, threading.Event(), threading.Event()

    def first_one_held(*args, **kwargs):
        if not first_encoding.is_set():
            first_encoding.set()
            assert release.wait(30)
        return encode(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "_encode", first_one_held)
    config = PrepareConfig(inputs=[str(corpus / "corpus")], out=str(tmp_path / "d"), tokenizer="bytes")
    said = {"first": [], "second": []}
    threads = {name: threading.Thread(target=prepare, args=(config, said[name].append)) for name in said}
    threads["first"].start()
    try:
        assert first_encoding.wait(30)
        threads["second"].start()
        threads["second"].join(1.0)
        assert threads["second"].is_alive(), said["second"]  # without the wait it is done in milliseconds
    finally:
        release.set()
        for thread in threads.values():
            if thread.ident is not None:
                thread.join(30)
    assert said["second"][0].startswith("waiting for another process that prepares data in")
    assert "reusing it" in said["second"][-1] and any(line.startswith("prepared ") for line in said["first"])
    assert PreparedData(str(tmp_path / "d")).meta.inputs


def test_shards_split_at_the_shard_size_and_windows_cross_their_edges(tmp_path):
    writer = ShardWriter(str(tmp_path), "train", np.dtype(np.uint16), shard_tokens=7)
    for start in range(0, 30, 6):
        writer.write(np.arange(start, start + 6))
    info = writer.close()
    assert [s.tokens for s in info.shards] == [7, 7, 7, 7, 2] and info.tokens == 30
    meta = shards.DataMeta(
        format=shards.FORMAT,
        version=shards.VERSION,
        vocab_size=100,
        dtype="uint16",
        tokenizer="bytes",
        val_fraction=0.0,
        text_field="text",
        documents=5,
        inputs=[],
        splits={"train": info},
    )
    split = TokenSplit(str(tmp_path), meta, "train")
    for start in range(0, 30):
        for length in (1, 5, 8, 30 - start):
            if start + length <= 30:
                assert split.window(start, length).tolist() == list(range(start, start + length))
    with pytest.raises(IndexError):
        split.window(25, 6)
    sampler = MicrobatchSampler(split, seq_len=8, batch_size=6, microbatch_size=2, seed=3)
    for mb in sampler.batch(0):
        assert torch.equal(mb.targets[:, :-1], mb.inputs[:, 1:])  # consecutive tokens, across shard edges
        assert torch.equal(mb.inputs[:, 1:] - mb.inputs[:, :-1], torch.ones(2, 7, dtype=torch.long))


def test_sampler_over_shards_matches_the_in_memory_sampler(corpus, tmp_path):
    run([corpus / "corpus"], tmp_path / "d", tokenizer="bytes", val_fraction=0.0)
    data = PreparedData(str(tmp_path / "d"))
    tokens = torch.from_numpy(data.train.window(0, len(data.train)))
    a = MicrobatchSampler(data.train, seq_len=16, batch_size=4, microbatch_size=2, seed=1).batch(5)
    b = MicrobatchSampler(tokens, seq_len=16, batch_size=4, microbatch_size=2, seed=1).batch(5)
    assert all(torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets) for x, y in zip(a, b))


def test_validation_batches_are_the_same_every_time(corpus, tmp_path):
    run([corpus / "docs.jsonl"], tmp_path / "d", tokenizer="bytes", val_fraction=0.5)
    data = PreparedData(str(tmp_path / "d"))
    batches = ValidationBatches(data.val, seq_len=16, batch_size=4, microbatch_size=2, count=3)
    first, second = batches.batches(), batches.batches()
    assert len(first) == 3 and all(len(b) == 2 for b in first)
    assert all(torch.equal(x.inputs, y.inputs) for b1, b2 in zip(first, second) for x, y in zip(b1, b2))


# --- bad input: one clear line, nothing half-written --------------------------------------------


def test_missing_and_empty_inputs_are_refused(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        run([tmp_path / "nope.txt"], tmp_path / "d")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CorpusError, match="is empty"):
        run([tmp_path / "empty.txt"], tmp_path / "d")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorpusError, match="holds no files"):
        run([tmp_path / "emptydir"], tmp_path / "d")
    (tmp_path / "bad.jsonl").write_text("{oops\n[1, 2]\n")
    with pytest.raises(CorpusError, match="holds no documents"):
        run([tmp_path / "bad.jsonl"], tmp_path / "d", tokenizer="bytes")
    assert not os.path.exists(tmp_path / "d" / "meta.json")


def test_an_unreadable_input_is_refused(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("text")
    (folder / "gone.txt").symlink_to(tmp_path / "deleted-target.txt")  # listed, but cannot be read
    with pytest.raises(CorpusError, match="cannot read input"):
        run([folder], tmp_path / "d")


def test_a_corrupt_gzip_is_refused(tmp_path):
    (tmp_path / "x.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(CorpusError, match="cannot read input"):
        run([tmp_path / "x.jsonl.gz"], tmp_path / "d", tokenizer="bytes")


def test_bad_tokenizer_arguments_are_refused(tmp_path):
    with pytest.raises(CorpusError, match="bpe:VOCAB with an integer"):
        TokenizerSpec.parse("bpe:lots")
    with pytest.raises(CorpusError, match="at least"):
        TokenizerSpec.parse("bpe:10")
    with pytest.raises(CorpusError, match="tokenizer.json"):
        TokenizerSpec.parse(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{ this is not a tokenizer")
    (tmp_path / "a.txt").write_text(text(1))
    with pytest.raises(CorpusError, match="does not parse"):
        run([tmp_path / "a.txt"], tmp_path / "d", tokenizer=str(tmp_path / "broken.json"))


def test_an_existing_tokenizer_file_is_used(corpus, tmp_path):
    run([corpus / "corpus"], tmp_path / "first", tokenizer="bpe:280")
    meta, _ = run([corpus / "docs.jsonl"], tmp_path / "second", tokenizer=str(tmp_path / "first" / "tokenizer.json"))
    assert meta.vocab_size == 280 and meta.tokenizer.startswith("file:")


def test_a_corpus_smaller_than_one_window_is_refused(tmp_path):
    (tmp_path / "tiny.txt").write_text("a few bytes")
    run([tmp_path / "tiny.txt"], tmp_path / "d", tokenizer="bytes", val_fraction=0.0)
    with pytest.raises(CorpusError, match="fewer than one window"):
        MicrobatchSampler(PreparedData(str(tmp_path / "d")).train, seq_len=32, batch_size=2, microbatch_size=1)


def test_interrupted_foreign_and_older_folders_are_refused(corpus, tmp_path):
    out = tmp_path / "d"
    run([corpus / "corpus"], out, tokenizer="bytes")
    meta_path = out / "meta.json"
    raw = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**raw, "version": 0}))
    with pytest.raises(CorpusError, match="format version 0"):
        read_meta(str(out))
    meta_path.write_text(json.dumps({**raw, "format": "something-else"}))
    with pytest.raises(CorpusError, match="not a swarm dataset"):
        PreparedData(str(out))
    meta_path.unlink()  # what an interrupted prepare leaves
    with pytest.raises(CorpusError, match="interrupted"):
        PreparedData(str(out))
    run([corpus / "corpus"], out, tokenizer="bytes")  # and prepare starts over
    assert PreparedData(str(out)).meta.documents == 2


def test_a_damaged_shard_is_refused(corpus, tmp_path):
    run([corpus / "corpus"], tmp_path / "d", tokenizer="bytes")
    with open(tmp_path / "d" / "train-00000.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CorpusError, match="damaged"):
        PreparedData(str(tmp_path / "d"))


def test_an_output_folder_with_other_files_is_refused(corpus, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    with pytest.raises(CorpusError, match="other files"):
        run([corpus / "corpus"], out, tokenizer="bytes")
    assert (out / "thesis.tex").read_text() == "precious" and sorted(os.listdir(out)) == ["thesis.tex"]


def test_documents_encoded_in_pieces_give_the_ids_of_the_whole_document(tmp_path):
    from swarm.data.tokenizer import DocumentEncoder, split_at_safe_boundaries, train_bpe

    rng = np.random.default_rng(5)
    lines = []
    for _ in range(400):  # words, runs of spaces and blank lines, tabs, trailing spaces, punctuation
        words = rng.choice(WORDS + ["  ", "\t", "x.y", "(a)", "'s", "42"], size=rng.integers(0, 12))
        lines.append(" ".join(words) + rng.choice(["", " ", "  ", "\t"]))
    document = "\n".join(lines) + "\n\n\n  indented\n"
    pieces = split_at_safe_boundaries(document, piece_chars=200)
    assert len(pieces) > 5 and "".join(pieces) == document
    tokenizer = train_bpe([document], 400)
    encoder = DocumentEncoder(tokenizer)
    (ids,) = list(encoder.encode([document]))
    whole = tokenizer.encode(document, add_special_tokens=False).ids
    assert ids[:-1].tolist() == whole and ids[-1] == tokenizer.token_to_id("<|endoftext|>")


def test_data_shards_draw_disjoint_windows_and_the_whole_split_is_shard_0_of_1():
    """--data-shard I/N: every window of trainer I starts in the I-th part of the tokens, so N
    trainers never draw the same window; 0/1 draws exactly what the sampler drew before shards."""
    tokens = torch.arange(10_000)  # token == its position: a window's first token is its start
    whole = MicrobatchSampler(tokens, seq_len=16, batch_size=8, microbatch_size=4, seed=2)
    g = torch.Generator().manual_seed(2 * 1_000_003 + 7)  # the draw of step 7 before shards existed
    expected = torch.randint(0, len(tokens) - 16 - 1, (8,), generator=g)
    assert torch.equal(torch.cat([mb.inputs for mb in whole.batch(7)])[:, 0], expected)
    starts = []
    for index in range(3):
        sampler = MicrobatchSampler(tokens, seq_len=16, batch_size=8, microbatch_size=4, seed=2, shard=(index, 3))
        drawn = torch.cat([mb.inputs for step in range(30) for mb in sampler.batch(step)])[:, 0]
        assert int(drawn.min()) >= 10_000 * index // 3 and int(drawn.max()) < 10_000 * (index + 1) // 3
        starts.append(set(drawn.tolist()))
    assert not (starts[0] & starts[1]) and not (starts[1] & starts[2])


def test_a_malformed_data_shard_is_one_line():
    from process.config import ConfigError
    from swarm.trainer.config import CorpusSettings

    assert CorpusSettings(data_shard="1/2").shard == (1, 2)
    for bad in ["2/2", "1", "a/b", "-1/2", "0/0"]:
        with pytest.raises(ConfigError, match="--data-shard"):
            CorpusSettings(data_shard=bad)
