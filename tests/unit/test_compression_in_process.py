"""benchmarks/compression.py --in-process on a tiny budget: the JSON's shape, and bytes per token
that follow from the model's width and the codecs' formats (no timing is checked)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.compression import main
from benchmarks.compression_rows import main as rows_main
from benchmarks.compression_rows import parse_rows
from models.config import get_model_config
from wire.compression.int4 import int4_nbytes


@pytest.mark.slow
def test_in_process_table_counts_boundary_bytes_from_the_encoded_payloads(tmp_path):
    out = tmp_path / "table.json"
    argv = ["--in-process", "--model", "tiny", "--stages", "3", "--tokens", "64", "--batch-size", "2"]
    argv += [
        "--microbatch-size",
        "1",
        "--eval-batches",
        "1",
        "--threads",
        "1",
        "--codecs",
        "fp32,int8,int4",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    config = get_model_config("tiny")
    assert (report["mode"], report["model"], report["boundaries"], report["hidden"]) == ("in-process", "tiny", 2, 32)
    assert report["steps"] == 1 and report["tokens_per_row"] == 2 * config.seq_len
    rows = {row["label"]: row for row in report["results"]}
    assert list(rows) == ["fp32", "int8", "int4"]
    for row in rows.values():
        assert row["tokens"] == report["tokens_per_row"] and len(row["train_losses"]) == 1
        assert math.isfinite(row["val_loss"]) and math.isfinite(row["val_loss_exact"])
    fp32 = rows["fp32"]
    assert fp32["activation_bytes_per_token"] == config.d_model * 4 * report["boundaries"]
    assert fp32["gradient_bytes_per_token"] == config.d_model * 4 * report["boundaries"]
    assert fp32["val_loss"] == fp32["val_loss_exact"] and fp32["val_loss_ratio_to_fp32"] == 1.0
    # Each microbatch's (1, T, C) activation crosses each boundary once as one int4 tensor.
    per_microbatch = int4_nbytes(config.seq_len * config.d_model)
    assert rows["int4"]["activation_bytes_per_token"] == per_microbatch / config.seq_len * report["boundaries"]
    assert rows["int4"]["fewer_bytes_than_fp32"] > 7.0
    assert 1.0 < rows["int8"]["fewer_bytes_than_fp32"] < rows["int4"]["fewer_bytes_than_fp32"]
    assert rows["int4"]["val_loss_ratio_to_fp32"] == rows["int4"]["val_loss"] / fp32["val_loss"]


def test_row_names_parse_into_codec_and_subspace():
    from benchmarks.compression_in_process import Row, parse_row

    codecs = ("none", "int8", "int4")
    assert parse_row("fp32", codecs) == Row()
    assert parse_row("int8", codecs) == Row(codec="int8")
    assert parse_row("fixed:16", codecs) == Row(subspace_rank=16, subspace_kind="fixed")
    assert parse_row("learned:64+int4", codecs) == Row(codec="int4", subspace_rank=64, subspace_kind="learned")
    assert parse_row("learned:64+int4", codecs).label == "learned:64+int4"
    # one codec each way: activations / gradients
    assert parse_row("int4/fp32", codecs) == Row(codec="int4", gradient_codec="none")
    assert parse_row("fp32/int4", codecs).backward_codec == "int4" and parse_row("fp32/int4", codecs).codec == "none"
    assert parse_row("fixed:16+int8/int4", codecs).label == "fixed:16+int8/int4"
    assert parse_row("int8", codecs).backward_codec == "int8"
    for bad in ("topk", "fixed:0", "pca:8", "fixed:8+zip", "int4/zip", "zip/int4"):
        with pytest.raises(ValueError):
            parse_row(bad, codecs)


@pytest.mark.slow
def test_subspace_rows_send_k_coefficients_and_the_token_ids(tmp_path):
    out = tmp_path / "table.json"
    argv = ["--in-process", "--model", "tiny", "--stages", "3", "--tokens", "64", "--batch-size", "2"]
    argv += ["--microbatch-size", "1", "--eval-batches", "1", "--threads", "1"]
    argv += ["--codecs", "fp32,fixed:8,learned:4", "--out", str(out)]
    assert main(argv) == 0
    rows = {row["label"]: row for row in json.loads(out.read_text())["results"]}
    for label, rank in (("fixed:8", 8), ("learned:4", 4)):
        row = rows[label]
        assert row["activation_bytes_per_token"] == row["gradient_bytes_per_token"] == rank * 4 * 2
        # the ids as the wire sends them, per boundary: tiny's 256-token vocabulary fits one byte an id
        assert row["token_id_bytes_per_token"] == 1 * 2
        assert row["bytes_per_token"] == 2 * rank * 4 * 2 + 2
    assert rows["fp32"]["token_id_bytes_per_token"] == 0


def test_rows_follow_the_peers_learning_rate_schedule():
    from benchmarks.compression_in_process import RunSpec

    spec = RunSpec(model="tiny", tokens=100 * 8 * 32, batch_size=8, lr=1e-3, lr_warmup_steps=10, lr_decay="cosine")
    schedule = spec.schedule
    assert spec.steps == 100 and schedule.decay_steps == 90
    assert schedule.rate(0) == pytest.approx(1e-4) and schedule.rate(9) == pytest.approx(1e-3)
    assert schedule.rate(99) == pytest.approx(1e-4, rel=0.01)  # a tenth of lr at the end, as the demo's
    assert RunSpec(model="tiny").schedule.rate(0) == RunSpec(model="tiny").lr  # constant unless asked


def test_row_list_takes_an_optional_seed_per_row():
    assert parse_rows("fp32,int8@1, fixed:16+int4/int8@2", default_seed=7) == [
        ("fp32", 7),
        ("int8", 1),
        ("fixed:16+int4/int8", 2),
    ]
    for bad in ("fp32,,int8", "int8@", "int8@x"):
        with pytest.raises(ValueError):
            parse_rows(bad, default_seed=0)


@pytest.mark.slow
def test_rows_side_by_side_merge_into_one_table_and_name_the_row_that_failed(tmp_path):
    out = tmp_path / "rows.json"
    argv = ["--jobs", "3", "--rows", "fp32,fp32@1,nosuchcodec", "--out", str(out), "--"]
    argv += ["--model", "tiny", "--stages", "2", "--tokens", "64", "--batch-size", "2", "--microbatch-size", "1"]
    argv += ["--eval-batches", "1", "--threads", "1"]
    assert rows_main(argv) == 1  # one row failed; the others are kept
    report = json.loads(out.read_text())
    assert report["missing"] == ["nosuchcodec@0"] and report["seeds"] == [0, 1]
    rows = {row["label"]: row for row in report["results"]}
    assert set(rows) == {"fp32", "fp32@1"} and (rows["fp32"]["seed"], rows["fp32@1"]["seed"]) == (0, 1)
    assert rows["fp32"]["val_loss_ratio_to_fp32"] == 1.0  # every ratio is to the first seed's fp32
    assert rows["fp32@1"]["val_loss_ratio_to_fp32"] == rows["fp32@1"]["val_loss"] / rows["fp32"]["val_loss"]
    assert rows["fp32"]["train_losses"] != rows["fp32@1"]["train_losses"]  # the seed reached the row
