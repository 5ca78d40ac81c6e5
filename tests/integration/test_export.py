"""Taking the trained model home: a 2-stage x 2-replica swarm (default averaging) trains, its
replicas agree, `swarm export` from the live peers and from their checkpoint folders give the same
tensors, the folder loads in plain PyTorch and in transformers with the swarm's loss, and
`swarm generate` prints text. The same for a llama model: transformers' LlamaForCausalLM computes
the project's logits on the exported folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from models.hf_format import read_model_folder
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from swarm.generate import head_logits
from swarm.trainer.data import MicrobatchSampler, load_corpus

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BATCH, MICROBATCH = 8, 2


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm.cli", *args], capture_output=True, text=True, timeout=timeout)


def train(swarm, tmp_path, steps: int, name: str) -> dict:
    report = tmp_path / f"{name}.json"
    trainer = swarm.start_trainer(
        "--num-stages", "2", "--steps", str(steps), "--batch-size", str(BATCH), "--microbatch-size", str(MICROBATCH),
        "--report", str(report), name=name,
    )  # fmt: skip
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    return json.loads(report.read_text())


def export_live(swarm, out) -> str:
    result = cli("export", "--initial-peers", *swarm.initial_peers, "--model", swarm.model, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def validation_batch(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's first batch (what a one-step run computes its loss on before stepping)."""
    sampler = MicrobatchSampler(load_corpus(), seq_len=seq_len, batch_size=BATCH, microbatch_size=MICROBATCH)
    microbatches = sampler.batch(0)
    return torch.cat([mb.inputs for mb in microbatches]), torch.cat([mb.targets for mb in microbatches])


def losses_of_folder(folder) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(plain PyTorch loss, transformers loss, PyTorch logits, transformers logits) on the validation batch."""
    config, model = read_model_folder(str(folder))
    inputs, targets = validation_batch(config.seq_len)
    with torch.no_grad():
        ours = head_logits(model, inputs)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()(inputs).logits
    loss = lambda logits: F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1)).item()  # noqa: E731
    return loss(ours), loss(theirs), ours, theirs


def tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_a_trained_swarm_exports_one_model_that_transformers_loads(make_swarm, tmp_path):
    swarm = make_swarm(model="tiny", num_stages=2, peer_args=["--optimizer", "sgd", "--lr", "0.3"])
    swarm.start_bootstrap()
    dirs = {(s, r): tmp_path / f"ckpt-s{s}-r{r}" for s in range(2) for r in range(2)}
    peers = [swarm.start_peer(s, "--checkpoint-dir", str(d)) for (s, _), d in dirs.items()]
    swarm.wait_online(peers)
    train(swarm, tmp_path, 3, "train")

    live = tmp_path / "live"
    printed = export_live(swarm, live)
    assert "disagree" not in printed and "after 3 steps" in printed, printed
    torch_loss, hf_loss, ours, theirs = losses_of_folder(live)
    assert torch.allclose(ours, theirs, atol=1e-5)
    # The swarm's loss on the same batch with the same parameters: a one-step run's loss before it steps.
    swarm_loss = train(swarm, tmp_path, 1, "eval")["losses"][0]
    assert torch_loss == pytest.approx(swarm_loss, abs=1e-4) and hf_loss == pytest.approx(swarm_loss, abs=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(live))
    assert tokenizer("To be, or not")["input_ids"] == list(b"To be, or not")

    # After that step: the live export, then the checkpoints the peers save when stopped, give the same tensors.
    after = tmp_path / "after"
    export_live(swarm, after)
    for peer in peers:
        peer.stop()
    for s in range(2):  # the replicas of each stage are equal
        a, b = (load_checkpoint(checkpoint_path(str(dirs[s, r]), "tiny", s, 2))[1] for r in range(2))
        assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a), s
    offline = tmp_path / "offline"
    result = cli("export", "--checkpoint-dir", *map(str, dirs.values()), "--model", "tiny", "--out", str(offline))
    assert result.returncode == 0, result.stderr
    live_tensors, offline_tensors = tensors(after), tensors(offline)
    assert live_tensors.keys() == offline_tensors.keys()
    assert all(torch.equal(live_tensors[n], offline_tensors[n]) for n in live_tensors)
    assert not all(torch.equal(live_tensors[n], tensors(live)[n]) for n in live_tensors)  # the step changed it

    refused = cli("export", "--checkpoint-dir", str(dirs[0, 0]), "--model", "tiny", "--out", str(offline))
    assert refused.returncode == 2 and "already exists" in refused.stderr and "Traceback" not in refused.stderr
    generated = cli("generate", "--model-dir", str(live), "--prompt", "ROMEO:", "--max-new-tokens", "20")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("ROMEO:") and len(generated.stdout.strip()) > len("ROMEO:")


def test_a_llama_swarm_exports_what_llama_for_causal_lm_computes(make_swarm, tmp_path):
    swarm = make_swarm(model="llama-tiny", num_stages=2, peer_args=["--optimizer", "sgd", "--lr", "0.3"])
    swarm.start_bootstrap()
    peers = [swarm.start_peer(s) for s in range(2)]
    swarm.wait_online(peers)
    train(swarm, tmp_path, 2, "train")
    folder = tmp_path / "llama"
    export_live(swarm, folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    torch_loss, hf_loss, ours, theirs = losses_of_folder(folder)
    assert torch.allclose(ours, theirs, atol=1e-5)
    swarm_loss = train(swarm, tmp_path, 1, "eval")["losses"][0]
    assert torch_loss == pytest.approx(swarm_loss, abs=1e-4) and hf_loss == pytest.approx(swarm_loss, abs=1e-4)


def test_an_export_waits_for_a_missing_stage_then_names_it(make_swarm, tmp_path):
    swarm = make_swarm(model="tiny", num_stages=2)
    swarm.start_bootstrap()
    swarm.wait_online([swarm.start_peer(0)])
    result = cli("export", "--initial-peers", *swarm.initial_peers, "--model", "tiny", "--num-stages", "2",
                 "--wait-s", "3", "--out", str(tmp_path / "out"))  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "stage 1 of tiny has no live replica (waited 3 s)" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
