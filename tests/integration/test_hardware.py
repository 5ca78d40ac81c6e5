"""Issue #12 on the CPU, with real processes: start-up refusals in one line, and a swarm whose
peers run with relays on, --device auto, 8-bit AdamW, bf16 autocast and initial weights from a
safetensors file, serving a trainer on loopback."""

from __future__ import annotations

import json
import re

import pytest
import torch

from models.config import get_model_config
from models.init_weights import save_full_weights
from models.stages import build_full_model
from tests.integration.test_bad_input import assert_one_line_error


@pytest.fixture(scope="module")
def bootstrap(module_swarm) -> list[str]:
    """The address of a bootstrap node: a peer joins a running swarm before it checks the rest."""
    swarm = module_swarm(num_stages=2, run=False)
    swarm.start_bootstrap()
    return swarm.initial_peers


@pytest.mark.parametrize(
    "args, fragments",
    [
        (
            ["peer", "--model", "llama-1b", "--stage", "0", "--num-stages", "2", "--memory-limit-gb", "2"],
            ["llama-1b stage 0/2", "does not fit", "--memory-limit-gb is 2.00 GiB", "serve fewer layers"],
        ),
        (
            ["peer", "--model", "gpt2-124m", "--stage", "1", "--num-stages", "2", "--memory-limit-gb", "4"],
            ["does not fit", "lower --max-batch-size"],
        ),
        (["peer", "--model", "tiny", "--stage", "0", "--device", "tpu"], ["--device 'tpu'", "auto"]),
        (["peer", "--model", "tiny", "--stage", "0", "--init-weights", "/no/such.safetensors"], ["no such file"]),
        (["peer", "--model", "tiny", "--stage", "0", "--num-layers", "many"], ["--num-layers 'many'"]),
    ],
)
def test_peers_refuse_what_cannot_work_in_one_line(swarm_cli, bootstrap, args, fragments):
    assert_one_line_error(swarm_cli(*args, "--initial-peers", *bootstrap), *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_on_a_cpu_machine_is_refused(swarm_cli, bootstrap):
    assert_one_line_error(
        swarm_cli("peer", "--model", "tiny", "--stage", "0", "--device", "cuda", "--initial-peers", *bootstrap),
        "torch sees no CUDA GPU",
        "--device cpu or auto",
    )


@pytest.mark.slow
def test_relay_enabled_peers_on_cpu_serve_a_trainer(make_swarm, tmp_path):
    config = get_model_config("tiny")
    weights = str(tmp_path / "init.safetensors")
    save_full_weights(build_full_model(config, seed=11), weights)
    swarm = make_swarm(
        num_stages=2,
        peer_args=[
            "--use-relay",
            "--use-auto-relay",
            "--device",
            "auto",
            "--optimizer",
            "adamw8bit",
            "--init-weights",
            weights,
            "--memory-limit-gb",
            "4",
            "--target-batch-size",
            "8",
        ],
    )
    swarm.start_bootstrap()
    first = swarm.start_peer(0)
    swarm.wait_online([first])
    # The second finds the first online, so its check has a helper; "always": on loopback "auto" skips it.
    second = swarm.start_peer(1, "--precision", "bf16", "--reachability-check", "always")
    swarm.wait_online([second])
    report = str(tmp_path / "report.json")
    trainer = swarm.start_trainer(
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--microbatch-size",
        "4",
        "--num-stages",
        "2",
        "--use-auto-relay",
        "--report",
        report,
    )
    assert trainer.popen.wait(timeout=240) == 0, trainer.log()
    with open(report) as f:
        assert json.load(f)  # the trainer finished and wrote its report
    for peer in (first, second):
        log = peer.log()
        assert "device: cpu" in log and "(--device auto)" in log, log
        assert "optimizer adamw8bit" in log and re.search(r"memory: stage \d+ needs about", log), log
        assert "initial tensors of stage" in log, log
    assert "precision bf16" in second.log()
    # The second peer asked the first to dial it back on a fresh connection.
    assert "reachability: 1/1 peer(s) could dial this peer directly" in second.log(), second.log()
    assert "reachability: not checked: it listens on loopback only" in first.log(), first.log()
