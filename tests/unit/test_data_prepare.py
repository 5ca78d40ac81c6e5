"""`swarm data prepare`: shards, the split by document, reuse, and every bad input refused in one line
with nothing half-written. Real files, real `tokenizers`."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from swarm.cli import main
from swarm.data.errors import DataError
from swarm.data.prepare import PrepareConfig, is_validation_document, prepare
from swarm.data.shards import META_FILE, read_meta
from swarm.data.windows import ShardedTokens


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def corpus(tmp_path, n=10):
    """n documents: text files in a nested folder and a jsonl file, each with its own marker line."""
    folder = tmp_path / "in"
    for i in range(n // 2):
        write(folder / "texts" / f"doc{i}.txt", f"document {i} " + "the quick brown fox " * 30)
    lines = [json.dumps({"text": f"jsonl {i} " + "jumps over the lazy dog " * 30}) for i in range(n - n // 2)]
    write(folder / "more.jsonl", "\n".join(lines) + "\n")
    return str(folder)


def text_of(tokens: ShardedTokens) -> str:
    return tokens.read(0, len(tokens)).astype(np.uint8).tobytes().decode()


def run(tmp_path, inputs, **kw):
    return prepare(PrepareConfig(inputs=inputs, out=str(tmp_path / "out"), **kw), say=lambda _: None)


def test_documents_go_to_validation_evenly_by_position():
    chosen = [i for i in range(100) if is_validation_document(i, 0.1)]
    assert len(chosen) == 10 and chosen[:2] == [9, 19]
    assert not any(is_validation_document(i, 0.0) for i in range(100))


def test_bytes_shards_hold_every_byte_of_every_document_once(tmp_path):
    inputs = corpus(tmp_path)
    meta = run(tmp_path, [inputs], val_fraction=0.2, shard_tokens=1000)
    out = str(tmp_path / "out")
    assert (meta.vocab_size, meta.dtype, meta.documents) == (256, "uint8", 10)
    assert meta.splits["val"].documents == 2 and meta.splits["train"].documents == 8
    assert len(meta.splits["train"].shards) > 1  # several shards: windows cross their edges
    train, val = ShardedTokens(out, meta, "train"), ShardedTokens(out, meta, "val")
    text = text_of(train) + text_of(val)
    assert sorted(text.count(f"document {i} ") for i in range(5)) == [1] * 5
    assert len(train) + len(val) == meta.text_bytes
    # a document is in one split only: the val split holds whole documents
    val_text = text_of(val)
    assert val_text.count("the quick") + val_text.count("jumps over") == 60


def test_the_byte_tokenizer_json_gives_the_same_ids(tmp_path):
    meta = run(tmp_path, [corpus(tmp_path)])
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    train = ShardedTokens(str(tmp_path / "out"), meta, "train")
    ids = train.read(0, 200).tolist()
    assert tokenizer.encode(bytes(ids).decode()).ids == ids


def test_bpe_is_trained_on_the_inputs_and_roundtrips(tmp_path):
    meta = run(tmp_path, [corpus(tmp_path)], tokenizer="bpe:300")
    out = str(tmp_path / "out")
    assert meta.dtype == "uint16" and 257 <= meta.vocab_size <= 300 and meta.eos_id is not None
    tokenizer = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    train = ShardedTokens(out, meta, "train")
    ids = train.read(0, len(train))
    first_doc = ids[: int(np.argmax(ids == meta.eos_id))].tolist()
    assert tokenizer.decode(first_doc).startswith("jsonl 0 jumps over the lazy dog")
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.eos_token_id == meta.eos_id and loaded.decode(first_doc) == tokenizer.decode(first_doc)
    # an existing tokenizer.json is used as it is
    again = prepare(
        PrepareConfig(
            inputs=[str(tmp_path / "in")], out=str(tmp_path / "out2"), tokenizer=os.path.join(out, "tokenizer.json")
        ),
        say=lambda _: None,
    )
    assert (
        again.vocab_size == meta.vocab_size
        and ShardedTokens(str(tmp_path / "out2"), again, "train").read(0, 50).tolist() == ids[:50].tolist()
    )


def test_a_rerun_on_the_same_inputs_reuses_the_folder_and_a_changed_input_prepares_again(tmp_path):
    inputs = corpus(tmp_path)
    said = []
    run(tmp_path, [inputs])
    stamp = os.path.getmtime(tmp_path / "out" / META_FILE)
    prepare(PrepareConfig(inputs=[inputs], out=str(tmp_path / "out")), say=said.append)
    assert any("reusing" in line for line in said) and os.path.getmtime(tmp_path / "out" / META_FILE) == stamp
    write(os.path.join(inputs, "texts", "doc0.txt"), "changed " * 50)
    meta = run(tmp_path, [inputs])
    assert meta.recipe == read_meta(str(tmp_path / "out")).recipe and "changed changed" in text_of(
        ShardedTokens(str(tmp_path / "out"), meta, "train")
    ) + text_of(ShardedTokens(str(tmp_path / "out"), meta, "val"))
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p or ".old" in p]


def test_bad_jsonl_lines_are_counted_and_skipped(tmp_path):
    path = write(tmp_path / "d.jsonl.gz.txt", "")  # placeholder so the folder exists
    os.remove(path)
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write('{"body": "a good document here"}\nnot json\n[1, 2]\n{"text": "no body"}\n{"body": "another"}\n')
    meta = run(tmp_path, [str(gz)], text_field="body", val_fraction=0.0)
    assert (meta.documents, meta.bad_lines) == (2, 3)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda t: [str(t / "missing.txt")], "does not exist"),
        (lambda t: [write(t / "empty.txt", "")], "every input is empty"),
        (lambda t: [str((t / "emptydir").mkdir() or t / "emptydir")], "holds no files"),
        (lambda t: [write(t / "bad.jsonl", "not json\n{}\n")], "hold no document"),
    ],
)
def test_bad_inputs_are_refused_in_one_line_and_leave_nothing(tmp_path, setup, message):
    inputs = setup(tmp_path)
    with pytest.raises(DataError, match=message) as e:
        run(tmp_path, inputs)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "out")
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]


def test_an_unreadable_input_is_refused(tmp_path):
    path = write(tmp_path / "secret.txt", "text")
    os.chmod(path, 0)
    if os.access(path, os.R_OK):
        pytest.skip("running as root: every file is readable")
    with pytest.raises(DataError, match="not readable"):
        run(tmp_path, [path])


def test_a_tokenizer_file_that_does_not_parse_is_refused(tmp_path):
    bad = write(tmp_path / "tokenizer.json", '{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="does not parse as a tokenizer.json"):
        run(tmp_path, [corpus(tmp_path)], tokenizer=bad)
    with pytest.raises(DataError, match="bpe:VOCAB"):
        run(tmp_path, [corpus(tmp_path)], tokenizer="bpe:lots")
    assert not os.path.exists(tmp_path / "out")


def test_interrupted_older_and_foreign_folders_are_refused_in_one_line(tmp_path):
    run(tmp_path, [corpus(tmp_path)])
    out = str(tmp_path / "out")
    meta_path = os.path.join(out, META_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump({**meta, "version": 0}, f)
    with pytest.raises(DataError, match="format version 0"):
        read_meta(out)
    with open(meta_path, "w") as f:
        json.dump({"format": "something-else"}, f)
    with pytest.raises(DataError, match="not a swarm dataset"):
        read_meta(out)
    os.remove(meta_path)  # what an interrupted prepare would leave, were it written in place
    with pytest.raises(DataError, match="interrupted"):
        read_meta(out)


def test_the_cli_prints_one_line_for_a_bad_input(tmp_path, capsys):
    assert main(["data", "prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
