"""Hugging Face folders: our blocks loaded from a folder that transformers wrote compute its logits;
a folder we write loads in transformers with the same logits; one stage reads only its tensors;
bad folders are refused in one line with nothing loaded. Small random models made here, nothing
downloaded."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models.hf_format import (  # noqa: E402
    ModelFolderError,
    from_hf_config,
    load_stage_from_folder,
    read_hf_config,
    read_model_folder,
    write_model_folder,
)
from models.stages import build_full_model, build_stage  # noqa: E402
from tests.hf_models import KINDS  # noqa: E402
from tests.hf_models import make_hf_folder as make_models_folder  # noqa: E402

VOCAB, SEQ = 101, 16


def make_hf_folder(path, kind: str, *, shard: bool = False):
    return make_models_folder(path, kind, vocab=VOCAB, seq_len=SEQ, shard=shard)


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def our_logits(model, x):
    with torch.no_grad():
        h = model.embedding(x)
        for block in model.blocks:
            h = block(h)
        return model.head(h)


@pytest.mark.parametrize("kind", KINDS)
def test_a_folder_from_transformers_computes_its_logits(tmp_path, kind):
    reference = make_hf_folder(tmp_path / "m", kind)
    config, model = read_model_folder(str(tmp_path / "m"))
    x = tokens()
    with torch.no_grad():
        expected = reference(x).logits
    torch.testing.assert_close(our_logits(model, x), expected, rtol=0, atol=1e-4)
    assert config.vocab_size == VOCAB and config.seq_len == SEQ and config.n_layers == 3


@pytest.mark.parametrize("kind", ["gpt2-tied", "llama", "llama-gqa-tied"])
def test_our_folder_loads_in_transformers_with_the_same_logits(tmp_path, kind):
    make_hf_folder(tmp_path / "m", kind)
    config, model = read_model_folder(str(tmp_path / "m"))
    out = write_model_folder(config, model.state_dict(), str(tmp_path / "out"), extra_meta={"step": 3})
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "swarm.json"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not reloaded.config.tie_word_embeddings  # the head is written apart from the embedding
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, our_logits(model, x), rtol=0, atol=1e-4)
    with open(os.path.join(out, "swarm.json")) as f:
        assert json.load(f)["step"] == 3
    again, _ = read_hf_config(out)
    assert again.to_dict() | {"name": config.name} == config.to_dict()


def test_a_project_model_round_trips_through_a_folder(tmp_path):
    import dataclasses

    from models.config import get_model_config

    gqa = dataclasses.replace(get_model_config("llama-tiny"), name="llama-gqa", n_kv_heads=2)
    for config in (get_model_config("tiny"), get_model_config("llama-tiny"), gqa):
        name = config.name
        model = build_full_model(config, seed=5)
        out = write_model_folder(config, model.state_dict(), str(tmp_path / name))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        x = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(reloaded(x).logits, our_logits(model, x), rtol=0, atol=1e-4)
        _, back = read_model_folder(out)
        for key, value in model.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), key


def test_a_stage_reads_only_its_tensors_from_a_sharded_folder(tmp_path):
    make_hf_folder(tmp_path / "m", "gpt2-tied", shard=True)
    folder = str(tmp_path / "m")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    config, full = read_model_folder(folder)
    last = build_stage(config, 1, 2)
    assert load_stage_from_folder(last, folder) == len(last.state_dict())
    offset = last.spec.first_layer
    for name, value in last.state_dict().items():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            name = f"blocks.{int(i) + offset}.{rest}"
        assert torch.equal(value, full.state_dict()[name]), name
    # tied: the last stage's head is the embedding's tensor
    assert torch.equal(last.head.out.weight, full.embedding.tok.weight)
    # a stage never opens the shards it does not need: remove one that only the first stage reads
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    stage_files = {weight_map[n] for n in weight_map if n.startswith(("transformer.h.2.", "transformer.ln_f"))}
    stage_files.add(weight_map["transformer.wte.weight"])
    unneeded = sorted(set(weight_map.values()) - stage_files)
    assert unneeded
    for file in unneeded:
        os.remove(os.path.join(folder, file))
    load_stage_from_folder(build_stage(config, 1, 2), folder)
    with pytest.raises(ModelFolderError, match="is missing"):
        load_stage_from_folder(build_stage(config, 0, 2), folder)


@pytest.mark.parametrize("kind", ["gpt2-tied", "llama-gqa-tied"])
def test_float32_tensors_are_read_straight_into_the_parameters(tmp_path, kind, monkeypatch):
    """Copied, concatenated (Llama's q, k, v) and transposed (GPT-2's Conv1D, here through a buffer
    of a few rows, so in several chunks with a remainder) without a whole-tensor temporary: the
    converting fallback is never taken, and the weights equal transformers' own."""
    import models.hf_format as hf_format

    reference = make_hf_folder(tmp_path / "m", kind)
    config, _ = read_hf_config(str(tmp_path / "m"))
    monkeypatch.setattr(hf_format, "_CHUNK_BYTES", 4 * config.hidden_size * 3)  # 3 rows of c_fc at a time

    def no_fallback(how, tensors):
        raise AssertionError(f"a float32 tensor was converted through a temporary ({how})")

    monkeypatch.setattr(hf_format, "from_hf_tensors", no_fallback)
    model = build_full_model(config)
    load_stage_from_folder(model, str(tmp_path / "m"))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, x), reference(x).logits, rtol=0, atol=1e-4)
    if kind.startswith("gpt2"):
        c_fc = reference.transformer.h[1].mlp.c_fc.weight  # (in, out), transposed in the project
        assert torch.equal(model.blocks[1].mlp.up.weight, c_fc.detach().t())


def _unchanged_after(folder, match):
    config = from_hf_config(json.load(open(os.path.join(folder, "config.json"))), name="m")
    stage = build_stage(config, 0, 1, seed=9)
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    with pytest.raises(ModelFolderError, match=match) as info:
        load_stage_from_folder(stage, folder)
    assert "\n" not in str(info.value)
    for k, v in stage.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was changed by a refused load"


def test_bad_folders_are_refused_in_one_line(tmp_path):
    with pytest.raises(ModelFolderError, match="no such folder"):
        read_hf_config(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFolderError, match="not a model folder"):
        read_hf_config(str(tmp_path / "empty"))
    with pytest.raises(ModelFolderError, match=r"model_type 'bert' is not supported; supported: gpt2 .*llama"):
        from_hf_config({"model_type": "bert"}, name="b")
    gqa = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 3}
    with pytest.raises(ModelFolderError, match="num_key_value_heads=3 that does not divide"):
        from_hf_config(gqa, name="g")
    with pytest.raises(ModelFolderError, match="rope scaling"):
        from_hf_config({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, name="r")

    folder = tmp_path / "m"
    make_hf_folder(folder, "llama")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    _unchanged_after(str(folder), "truncated or not safetensors|not readable safetensors")
    weights.unlink()
    with pytest.raises(ModelFolderError, match="has no model.safetensors"):
        read_model_folder(str(folder))

    folder = tmp_path / "sizes"
    make_hf_folder(folder, "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["n_inner"] = 64  # the tensors hold 4 * 32 = 128
    (folder / "config.json").write_text(json.dumps(config))
    _unchanged_after(str(folder), "does not fit the sizes of its config.json")

    folder = tmp_path / "missing-head"
    make_hf_folder(folder, "gpt2-tied")
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False  # claims an lm_head.weight the file does not hold
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="has no tensor 'lm_head.weight'"):
        read_model_folder(str(folder))


def test_an_existing_output_folder_is_refused_and_nothing_is_half_written(tmp_path):
    from models.config import get_model_config

    config = get_model_config("tiny")
    state = build_full_model(config).state_dict()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ModelFolderError, match="already exists"):
        write_model_folder(config, state, str(out))
    write_model_folder(config, state, str(out), overwrite=True)
    assert (out / "model.safetensors").is_file()
    partial = dict(state)
    partial.pop("head.out.weight")
    with pytest.raises(ModelFolderError, match="not a whole"):
        write_model_folder(config, partial, str(tmp_path / "out2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_bfloat16_folder_loads_as_float32(tmp_path):
    reference = make_hf_folder(tmp_path / "m32", "llama")
    reference.to(torch.bfloat16).save_pretrained(str(tmp_path / "m16"))
    # the bf16 values widened to float32 (what our stage must hold), rotary tables made afresh
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m16"), dtype=torch.float32).eval()
    _, model = read_model_folder(str(tmp_path / "m16"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, x), reference(x).logits, rtol=0, atol=1e-4)


def test_the_tokenizer_and_metadata_travel_with_the_model(tmp_path):
    from models.config import get_model_config

    config = get_model_config("tiny")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": {"type": "BPE"}}')
    out = write_model_folder(
        config,
        build_full_model(config).state_dict(),
        str(tmp_path / "out"),
        tokenizer_json=str(tokenizer),
        extra_meta={"step": 7},
        eos_token_id=0,
    )
    assert (tmp_path / "out" / "tokenizer.json").read_text() == tokenizer.read_text()
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"eos_token_id": 0}
    meta = json.loads((tmp_path / "out" / "swarm.json").read_text())
    assert meta["step"] == 7 and meta["config"] == config.to_dict()
    with pytest.raises(ModelFolderError, match="no such file"):
        write_model_folder(config, build_full_model(config).state_dict(), str(tmp_path / "x"), tokenizer_json="nope")
    assert out == str(tmp_path / "out")


def test_gpt2_tensors_saved_without_the_transformer_prefix_load(tmp_path):
    """The original GPT-2 checkpoints name their tensors `h.0...`, `wte.weight` (saved from the base
    model), with the head tied to `wte.weight`."""
    from safetensors.torch import load_file, save_file

    reference = make_hf_folder(tmp_path / "m", "gpt2-tied")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}, str(path))
    _, model = read_model_folder(str(tmp_path / "m"))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, x), reference(x).logits, rtol=0, atol=1e-4)
