"""Windows drawn from memory-mapped shards: the same as from the tokens in memory, across shard
edges, deterministic per (seed, step); validation windows fixed; too small a corpus refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.data.errors import DataError
from swarm.data.shards import FORMAT, FORMAT_VERSION, DataMeta, ShardWriter, SplitInfo
from swarm.data.windows import MicrobatchSampler, ShardedTokens, validation_batches


def sharded(tmp_path, tokens: np.ndarray, shard_tokens: int) -> ShardedTokens:
    writer = ShardWriter(str(tmp_path), "train", np.uint16, shard_tokens)
    writer.write(tokens[: len(tokens) // 3])
    writer.write(tokens[len(tokens) // 3 :])  # a second write continues the open shard
    meta = DataMeta(
        format=FORMAT,
        version=FORMAT_VERSION,
        vocab_size=1000,
        dtype="uint16",
        tokenizer="test",
        documents=1,
        text_bytes=0,
        val_fraction=0.0,
        text_field="text",
        splits={"train": writer.close(), "val": SplitInfo(tokens=0, documents=0)},
        inputs=[],
        recipe="x",
    )
    return ShardedTokens(str(tmp_path), meta, "train")


def test_reads_across_shard_edges_match_the_tokens(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 997
    stream = sharded(tmp_path, tokens, shard_tokens=64)
    assert len(stream.fds) == 16 and len(stream) == 1000
    for start in (0, 60, 63, 64, 127, 500, 1000 - 70):
        assert stream.read(start, 70).tolist() == tokens[start : start + 70].tolist()
    with pytest.raises(IndexError):
        stream.read(990, 20)


def test_the_sampler_draws_the_same_windows_from_shards_as_from_memory(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.uint16)
    stream = sharded(tmp_path, tokens, shard_tokens=100)  # windows of 33 often cross an edge
    in_memory = torch.from_numpy(tokens.astype(np.int64))
    a = MicrobatchSampler(stream, seq_len=32, batch_size=16, microbatch_size=4, seed=3)
    b = MicrobatchSampler(in_memory, seq_len=32, batch_size=16, microbatch_size=4, seed=3)
    for step in (0, 1, 7):
        for x, y in zip(a.batch(step), b.batch(step)):
            assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
            assert torch.equal(x.inputs[:, 1:], x.targets[:, :-1])
    assert not torch.equal(a.batch(0)[0].inputs, a.batch(1)[0].inputs)


def test_validation_batches_are_fixed_and_reach_the_end(tmp_path):
    tokens = np.arange(3000, dtype=np.uint16)
    stream = sharded(tmp_path, tokens, shard_tokens=128)
    first = validation_batches(stream, seq_len=16, batch_size=8, microbatch_size=4, batches=3)
    again = validation_batches(stream, seq_len=16, batch_size=8, microbatch_size=4, batches=3)
    assert len(first) == 3 and all(len(batch) == 2 for batch in first)
    assert all(torch.equal(a.inputs, b.inputs) for x, y in zip(first, again) for a, b in zip(x, y))
    assert int(first[0][0].inputs[0, 0]) == 0 and int(first[-1][-1].targets[-1, -1]) == 2999


def test_a_corpus_smaller_than_one_window_is_refused_in_one_line(tmp_path):
    stream = sharded(tmp_path, np.arange(20, dtype=np.uint16), shard_tokens=8)
    with pytest.raises(DataError, match="fewer than one window") as e:
        MicrobatchSampler(stream, seq_len=32, batch_size=4, microbatch_size=4)
    assert "\n" not in str(e.value)
