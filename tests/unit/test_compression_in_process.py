"""benchmarks/compression.py --in-process on a tiny budget: the JSON's shape, and bytes per token
that follow from the model's width and the codecs' formats (no timing is checked)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.compression import main
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
