"""Taking the trained model home: a 2-stage x 2-replica swarm (default averaging) trains on a
BPE-prepared corpus, its replicas agree, `swarm export` from the live peers and from their checkpoint folders give the same
tensors, the folder loads in plain PyTorch and in transformers with `swarm eval`'s loss, and
`swarm generate` prints text. The same for a llama model: transformers' LlamaForCausalLM computes
the project's logits on the exported folder."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from models.hf_format import read_model_folder
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from swarm.data.shards import PreparedData
from swarm.trainer.data import ValidationBatches
from tests.integration.test_corpus import write_corpus

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB, BATCH, MICROBATCH, EVAL_BATCHES = 512, 8, 4, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory, swarm_cli) -> str:
    """A BPE-prepared corpus (`swarm data prepare`), shared by the tests of this module."""
    root = tmp_path_factory.mktemp("corpus")
    prepared = swarm_cli(
        "data", "prepare", *write_corpus(root), "--out", str(root / "data"), "--tokenizer", f"bpe:{VOCAB}"
    )
    assert prepared.returncode == 0, prepared.stderr
    return str(root / "data")


def start_swarm(make_swarm, model: str, replicas: int, tmp_path) -> tuple:
    """2 stages x `replicas` peers with the default averaging, each with its own checkpoint folder."""
    swarm = make_swarm(
        model=model, num_stages=2, peer_args=["--vocab-size", str(VOCAB), "--optimizer", "sgd", "--lr", "0.3"]
    )
    swarm.start_bootstrap()
    dirs = {(s, r): tmp_path / f"ckpt-s{s}-r{r}" for s in range(2) for r in range(replicas)}
    peers = [swarm.start_peer(s, "--checkpoint-dir", str(d)) for (s, _), d in dirs.items()]
    swarm.wait_online(peers)
    return swarm, peers, dirs


def train(swarm, data: str, steps: int) -> None:
    trainer = swarm.start_trainer(
        "--data", data, "--num-stages", "2", "--steps", str(steps), "--batch-size", str(BATCH),
        "--microbatch-size", str(MICROBATCH), "--eval-every", "0",
    )  # fmt: skip
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]


def swarm_eval(swarm_cli, swarm, data: str, tmp_path) -> float:
    """`swarm eval`: the validation loss of what the swarm holds now (forward only)."""
    out = tmp_path / "eval.json"
    result = swarm_cli(
        "eval", "--initial-peers", *swarm.initial_peers, "--model", swarm.model, "--data", data,
        "--batches", str(EVAL_BATCHES), "--batch-size", str(BATCH), "--microbatch-size", str(MICROBATCH),
        "--json-out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(out.read_text())["eval_loss"]


def export_live(swarm_cli, swarm, data: str, out) -> str:
    result = swarm_cli(
        "export", "--initial-peers", *swarm.initial_peers, "--model", swarm.model, "--data", data, "--out", str(out),
        *swarm.run_args(),  # the run's owner may download the replicas' state
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def losses_of_folder(folder, data: str) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(plain PyTorch loss, transformers loss, PyTorch logits, transformers logits) on the batches
    `swarm eval` uses (the validation split, drawn from its own seed)."""
    config, model = read_model_folder(str(folder))
    batches = ValidationBatches(
        PreparedData(data).val, seq_len=config.seq_len, batch_size=BATCH, microbatch_size=MICROBATCH, count=EVAL_BATCHES
    ).batches()
    inputs = torch.cat([mb.inputs for batch in batches for mb in batch])
    targets = torch.cat([mb.targets for batch in batches for mb in batch])
    with torch.no_grad():
        ours = model.logits(inputs)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()(inputs).logits
    loss = lambda logits: F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1)).item()  # noqa: E731
    return loss(ours), loss(theirs), ours, theirs


def tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_a_trained_swarm_exports_one_model_that_transformers_loads(make_swarm, tmp_path, data, swarm_cli):
    swarm, peers, dirs = start_swarm(make_swarm, "tiny", 2, tmp_path)
    train(swarm, data, 3)

    live = tmp_path / "live"
    printed = export_live(swarm_cli, swarm, data, live)
    assert "disagree" not in printed and "after 3 steps" in printed and f"vocabulary {VOCAB}" in printed, printed
    torch_loss, hf_loss, ours, theirs = losses_of_folder(live, data)
    assert torch.allclose(ours, theirs, atol=1e-5)
    swarm_loss = swarm_eval(swarm_cli, swarm, data, tmp_path)
    assert torch_loss == pytest.approx(swarm_loss, abs=1e-4) and hf_loss == pytest.approx(swarm_loss, abs=1e-4)
    text = "ba de fi, go hu."
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(live))
    assert tokenizer(text)["input_ids"] == Tokenizer.from_file(PreparedData(data).tokenizer_path).encode(text).ids

    # The checkpoints the peers save when stopped give the same tensors as the live export.
    for peer in peers:
        peer.stop()
    for s in range(2):  # the replicas of each stage are equal
        a, b = (load_checkpoint(checkpoint_path(str(dirs[s, r]), "tiny", s, 2))[1] for r in range(2))
        assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a), s
    offline = tmp_path / "offline"
    checkpoints = ["export", "--checkpoint-dir", *map(str, dirs.values()), "--model", "tiny", "--out", str(offline)]
    untokenized = swarm_cli(*checkpoints)  # a BPE run's tokenizer is only in its data: refused, nothing written
    assert untokenized.returncode == 2 and "pass --data DIR" in untokenized.stderr, untokenized.stderr
    assert len(untokenized.stderr.strip().splitlines()) == 1 and not offline.exists()
    result = swarm_cli(*checkpoints, "--data", data)
    assert result.returncode == 0, result.stderr
    offline_tokenizer = transformers.AutoTokenizer.from_pretrained(str(offline))
    assert offline_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"] != []
    live_tensors, offline_tensors = tensors(live), tensors(offline)
    assert live_tensors.keys() == offline_tensors.keys()
    assert all(torch.equal(live_tensors[n], offline_tensors[n]) for n in live_tensors)

    refused = swarm_cli("export", "--checkpoint-dir", str(dirs[0, 0]), "--model", "tiny", "--out", str(offline))
    assert refused.returncode == 2 and "already exists" in refused.stderr and "Traceback" not in refused.stderr
    generated = swarm_cli("generate", "--model-dir", str(live), "--prompt", "ba de", "--max-new-tokens", "20")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("ba de") and len(generated.stdout.strip()) > len("ba de")


def test_a_llama_swarm_exports_what_llama_for_causal_lm_computes(make_swarm, tmp_path, data, swarm_cli):
    swarm, _, _ = start_swarm(make_swarm, "llama-tiny", 1, tmp_path)
    train(swarm, data, 2)
    folder = tmp_path / "llama"
    export_live(swarm_cli, swarm, data, folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    torch_loss, hf_loss, ours, theirs = losses_of_folder(folder, data)
    assert torch.allclose(ours, theirs, atol=1e-5)
    swarm_loss = swarm_eval(swarm_cli, swarm, data, tmp_path)
    assert torch_loss == pytest.approx(swarm_loss, abs=1e-4) and hf_loss == pytest.approx(swarm_loss, abs=1e-4)


def test_a_missing_stage_is_named_and_disagreeing_replicas_are_reported(make_swarm, tmp_path, swarm_cli):
    """Two replicas of stage 0 that do not average (--averaging none) and no stage 1: the export
    waits, then names stage 1; once stage 1 is served and training made the replicas diverge, it
    exports the most-trained replica of stage 0 and says that they disagree."""
    swarm = make_swarm(model="tiny", num_stages=2, peer_args=["--averaging", "none", "--target-batch-size", "4"])
    swarm.start_bootstrap()
    swarm.wait_online([swarm.start_peer(0), swarm.start_peer(0)])
    out = tmp_path / "out"
    export = [
        "export",
        "--initial-peers",
        *swarm.initial_peers,
        "--model",
        "tiny",
        "--num-stages",
        "2",
        "--out",
        str(out),
        *swarm.run_args(),
    ]
    result = swarm_cli(*export, "--wait-s", "3")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert re.search(r"stage 1 of tiny has no live replica \(waited \d+ s\)", line), line
    assert not out.exists()

    swarm.wait_online([swarm.start_peer(1)])
    trainer = swarm.start_trainer("--num-stages", "2", "--steps", "2", "--batch-size", "8", "--microbatch-size", "2")
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    result = swarm_cli(*export)
    assert result.returncode == 0, result.stderr
    assert "warning: stage 0: its replicas disagree" in result.stdout, result.stdout
    assert "exporting the most-trained one" in result.stdout and out.is_dir()
