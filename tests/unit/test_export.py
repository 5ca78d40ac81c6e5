"""`swarm export` without a network: stages to one model, the checks that they fit, checkpoint
folders read and refused, the folder written atomically; `swarm generate`'s sampling loop."""

from __future__ import annotations

import dataclasses
import io
import os

import pytest
import torch
from transformers import GPT2LMHeadModel

from models.config import get_model_config
from models.hf_format import read_model_folder
from models.project_folder import load_model_folder
from models.stages import build_full_model, build_stage
from peers.compute.checkpoint import CheckpointError, CheckpointMeta, checkpoint_path, save_checkpoint
from swarm.export.assemble import (
    ExportError,
    StagePart,
    assemble_state,
    block_boundaries,
    check_stages_fit,
    choose_replica,
)
from swarm.export.offline import parse_checkpoint_name, read_checkpoint_parts
from swarm.export.run import write_export
from swarm.generate import GenerateConfig, generate_text, sample_tokens

TINY = get_model_config("tiny")


def parts_of(config, num_stages=2, boundaries=None, steps=3, seed=0) -> dict[int, StagePart]:
    return {
        s: StagePart(
            s, num_stages, steps, build_stage(config, s, num_stages, seed, boundaries).state_dict(), f"replica {s}"
        )
        for s in range(num_stages)
    }


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("boundaries", [None, (0, 1, 3)])
def test_stages_assemble_into_the_whole_model(model, boundaries):
    config = get_model_config(model)
    parts = parts_of(config, boundaries=boundaries)
    assert check_stages_fit(config, parts, boundaries=boundaries) == config
    state = assemble_state(parts, boundaries=block_boundaries(parts))
    reference = build_full_model(config).state_dict()
    assert set(state) == set(reference)
    assert all(torch.equal(state[name], reference[name]) for name in reference)


def test_the_vocabulary_comes_from_the_tensors():
    config = dataclasses.replace(TINY, vocab_size=300)
    assert check_stages_fit(TINY, parts_of(config)).vocab_size == 300


def test_stages_that_do_not_fit_are_refused():
    parts = parts_of(TINY)
    with pytest.raises(ExportError, match=r"stage\(s\) 1 of 2 missing"):
        check_stages_fit(TINY, {0: parts[0]})
    with pytest.raises(ExportError, match="describe the split 0,2,3, not the swarm's 0,1,3"):
        check_stages_fit(TINY, parts, boundaries=(0, 1, 3))
    other = parts_of(TINY, boundaries=(0, 1, 3))
    with pytest.raises(ExportError, match="no split of tiny's 3 blocks"):
        check_stages_fit(TINY, {0: parts[0], 1: other[1]})
    with pytest.raises(ExportError, match="different steps"):
        check_stages_fit(TINY, {0: parts[0], 1: dataclasses.replace(parts[1], steps_done=9)})
    small_vocab = parts_of(dataclasses.replace(TINY, vocab_size=100))
    with pytest.raises(ExportError, match="vocabulary of 256 tokens, stage 1 one of 100"):
        check_stages_fit(TINY, {0: parts[0], 1: small_vocab[1]})
    with pytest.raises(ExportError, match="another model"):
        check_stages_fit(get_model_config("llama-tiny"), parts)


def test_the_most_trained_replica_is_chosen_and_a_disagreement_named():
    part = parts_of(TINY)[1]
    same = dataclasses.replace(part, source="replica b")
    assert choose_replica([part, same]).disagreement is None
    changed = {name: t + 0.5 for name, t in part.state.items()}
    ahead = dataclasses.replace(part, state=changed, steps_done=5, source="replica c")
    choice = choose_replica([part, ahead])
    assert choose_replica([ahead, part]).part is ahead
    assert choice.part is ahead
    assert "stage 1: its replicas disagree (replica 1: 3 steps, max |difference| 0.5)" in choice.disagreement
    assert "exporting the most-trained one, replica c (5 steps)" in choice.disagreement


def save_stages(folder, model, config, num_stages=2, steps=3, tag=None, boundaries=None):
    for s in range(num_stages):
        module = build_stage(config, s, num_stages, 0, boundaries)
        path = checkpoint_path(str(folder), model, s, num_stages, tag)
        save_checkpoint(path, CheckpointMeta(model, s, num_stages, steps), module.state_dict(), {})


def test_checkpoint_folders_are_read_and_bad_ones_refused(tmp_path):
    assert parse_checkpoint_name("tiny-stage1of2-split0-1-3.ckpt") == ("tiny", 1, 2, (0, 1, 3))
    assert parse_checkpoint_name("my-model-stage0of4.ckpt") == ("my-model", 0, 4, None)
    assert parse_checkpoint_name("notes.txt") is None
    a, b = tmp_path / "a", tmp_path / "b"
    save_stages(a, "tiny", TINY)
    save_stages(b, "tiny", TINY, steps=4)
    replicas, boundaries = read_checkpoint_parts([str(a), str(b)], "tiny", TINY.n_layers)
    assert boundaries == (0, 2, 3) and {s: len(ps) for s, ps in replicas.items()} == {0: 2, 1: 2}
    assert choose_replica(replicas[0]).part.steps_done == 4

    other_model = tmp_path / "other"
    save_stages(other_model, "small", get_model_config("small"))
    with pytest.raises(ExportError, match=r"holds no checkpoint of model tiny \(checkpoints of small\)"):
        read_checkpoint_parts([str(other_model)], "tiny", TINY.n_layers)
    other_split = tmp_path / "split"
    save_stages(other_split, "tiny", TINY, tag="0-1-3", boundaries=(0, 1, 3))
    with pytest.raises(ExportError, match="different splits"):
        read_checkpoint_parts([str(a), str(other_split)], "tiny", TINY.n_layers)
    path = checkpoint_path(str(a), "tiny", 1, 2)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint_parts([str(a)], "tiny", TINY.n_layers)


def test_the_folder_is_written_whole_and_loads_with_the_same_logits(tmp_path):
    parts = parts_of(TINY)
    config = check_stages_fit(TINY, parts)
    out = tmp_path / "model"
    write_export(config, parts, str(out), data=None, overwrite=False, extra_meta={"steps_done": 3})
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    _, loaded = read_model_folder(str(out))
    tokens = torch.randint(0, 256, (2, TINY.seq_len))
    reference = build_full_model(TINY)
    assert torch.allclose(loaded(tokens, tokens), reference(tokens, tokens), atol=1e-6)
    with pytest.raises(ExportError, match="already exists"):
        write_export(config, parts, str(out), data=None, overwrite=False, extra_meta={})
    write_export(config, parts, str(out), data=None, overwrite=True, extra_meta={})
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary folder left behind
    with pytest.raises(ExportError, match="has no tokenizer.json"):
        write_export(config, parts, str(tmp_path / "m2"), data=str(tmp_path), overwrite=False, extra_meta={})
    assert not (tmp_path / "m2").exists()

    text = io.StringIO()
    config = GenerateConfig(model_dir=str(out), prompt="To be", max_new_tokens=8, seed=1)
    continuation = generate_text(config, out=text)
    assert text.getvalue().startswith("To be") and text.getvalue().rstrip("\n").endswith(continuation)


def test_sampling_is_seeded_greedy_at_zero_temperature_and_crops_the_context():
    model = build_full_model(TINY).eval()
    prompt = list(range(TINY.seq_len + 5))  # longer than the context: cropped, not an error

    def sample(**kw):
        generator = torch.Generator().manual_seed(kw.pop("seed", 0))
        return list(sample_tokens(model, prompt, max_new_tokens=6, generator=generator, **kw))

    assert sample(temperature=1.0, top_k=None) == sample(temperature=1.0, top_k=None)
    greedy = sample(temperature=0.0, top_k=None)
    assert greedy == sample(temperature=0.0, top_k=None, seed=5)
    assert sample(temperature=1.0, top_k=1) == greedy


def test_stages_of_independent_replicas_may_be_at_different_steps():
    parts = parts_of(TINY)
    apart = {0: parts[0], 1: dataclasses.replace(parts[1], steps_done=9)}
    assert check_stages_fit(TINY, apart, steps_must_match=False) == TINY


@pytest.mark.parametrize("kind", ["fixed", "learned"])
def test_a_subspace_model_exports_to_a_folder_that_computes_the_same_logits(tmp_path, kind):
    config = dataclasses.replace(TINY, subspace_rank=8, subspace_kind=kind)
    boundaries, seed = (0, 1, 3), 5
    parts = parts_of(config, boundaries=boundaries, seed=seed)
    generator = torch.Generator().manual_seed(0)
    for part in parts.values():  # trained-looking weights: the fold must not rely on the initial ones
        for tensor in part.state.values():
            tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    reference = build_full_model(config, seed=seed, boundaries=boundaries)
    reference.load_state_dict(assemble_state(parts, boundaries=boundaries))
    fitted = check_stages_fit(config, parts, boundaries=boundaries)
    out = str(tmp_path / "model")
    write_export(fitted, parts, out, data=None, overwrite=False, extra_meta={}, seed=seed)
    loaded_config, loaded = load_model_folder(out)
    tokens = torch.randint(0, 256, (2, TINY.seq_len), generator=generator)
    with torch.no_grad():
        expected = reference.logits(tokens)
        torch.testing.assert_close(loaded.logits(tokens), expected, atol=1e-5, rtol=0)
    if kind == "fixed":  # folded into plain weights: a GPT-2 folder transformers loads
        assert "config.json" in os.listdir(out) and loaded_config.subspace_rank == 0
        with torch.no_grad():
            hf_logits = GPT2LMHeadModel.from_pretrained(out).eval()(tokens).logits
        torch.testing.assert_close(hf_logits, expected, atol=1e-4, rtol=0)
    else:  # the project's own format, rebuilt for the split it names
        assert "config.json" not in os.listdir(out)
        assert (loaded_config.subspace_kind, loaded_config.subspace_rank) == ("learned", 8)


def test_a_model_of_another_vocabulary_is_exported_with_its_tokenizer_or_not_at_all(tmp_path):
    """Without --data, a 300-token model has no tokenizer to write: refused, nothing written. With
    --model-dir's tokenizer.json (and its tokenizer_config.json), AutoTokenizer loads the export and
    encodes as that tokenizer does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from swarm.data.tokenizer import END_OF_TEXT, train_bpe

    texts = [f"ROMEO: line {i}, and what the nurse said." for i in range(300)]
    tokenizer = train_bpe(texts, 300)
    config = dataclasses.replace(TINY, vocab_size=tokenizer.get_vocab_size())
    parts = parts_of(config)
    with pytest.raises(ExportError, match="pass --data DIR"):
        write_export(config, parts, str(tmp_path / "none"), data=None, overwrite=False, extra_meta={})
    assert not (tmp_path / "none").exists() and os.listdir(tmp_path) == []

    model_dir = tmp_path / "base"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT).save_pretrained(str(model_dir))
    out = tmp_path / "model"
    write_export(config, parts, str(out), data=None, overwrite=False, extra_meta={}, model_dir=str(model_dir))
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert len(loaded) == tokenizer.get_vocab_size() and loaded.eos_token == END_OF_TEXT
    assert (
        loaded("ROMEO: hello")["input_ids"]
        == Tokenizer.from_file(str(out / "tokenizer.json")).encode("ROMEO: hello").ids
        != []
    )
