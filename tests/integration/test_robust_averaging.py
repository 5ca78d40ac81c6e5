"""A replica that lies in its stage's all-reduce (`--faults averaging`: its gradients x10, or
negated) among three sync replicas: the honest replicas reduce its contribution robustly
(`--robust-averaging clip`, the default; peers/replicas/robust_mean.py), so the stage's update stays
within the documented bound of the honest one, and every replica still holds the same parameters
(issue #25)."""

from __future__ import annotations

import re

import pytest
import torch

from models.config import get_model_config
from models.stages import build_full_model
from peers.compute.stage_runtime import OptimizerSettings
from swarm.local_swarm import fault_args
from swarm.trainer.data import MicrobatchSampler, open_data
from tests.integration.processes import stop_together
from tests.integration.test_replicas import assert_same_params, run_trainer, stage_params

pytestmark = pytest.mark.slow

BATCH, MICROBATCH, LR = 24, 2, 0.5  # 12 microbatches: each of the three replicas serves some
PEER_ARGS = ["--optimizer", "sgd", "--lr", str(LR), "--averaging", "sync"]


def one_text_repeated(tmp_path) -> str:
    """Data whose every sequence is the same: the honest replicas' mean gradients are then equal (to
    float rounding), so the documented bound, 2 F (w_liar / W) x their spread, is about zero."""
    path = tmp_path / "same.txt"
    path.write_text("a" * 20_000)
    return str(path)


def one_process_update(data: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's initial parameters and its parameters after one SGD step on the batch, in one process."""
    config = get_model_config("tiny")
    sampler = MicrobatchSampler(
        open_data(data).train, seq_len=config.seq_len, batch_size=BATCH, microbatch_size=MICROBATCH
    )
    microbatches = sampler.batch(0)
    model = build_full_model(config)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = OptimizerSettings(optimizer="sgd", lr=LR).build(model.parameters())
    model(torch.cat([mb.inputs for mb in microbatches]), torch.cat([mb.targets for mb in microbatches])).backward()
    optimizer.step()
    return initial, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_replica_scaling_its_gradients_in_the_all_reduce_moves_no_honest_update(make_swarm, tmp_path):
    """Three sync replicas of stage 0, one sending its gradients x10 (`--faults averaging=scale`;
    `flip` and other lies: tests/unit/test_robust_mean.py, test_fault_lies.py). Without the clip the
    stage would step on (1 + 9 w_liar / W) x the gradient; with it, the step is the one-process step."""
    data = one_text_repeated(tmp_path)
    swarm = make_swarm(num_stages=2, peer_args=PEER_ARGS)
    swarm.start_bootstrap()
    dirs = [tmp_path / name for name in ("a", "b", "liar")]
    honest = [swarm.start_peer(0, "--checkpoint-dir", str(d)) for d in dirs[:2]]
    liar = swarm.start_peer(0, "--checkpoint-dir", str(dirs[2]), "--no-load-state", *fault_args(averaging="scale"))
    last = swarm.start_peer(1)
    processes = [*honest, liar, last]
    swarm.wait_online(processes)
    report = run_trainer(
        swarm,
        tmp_path,
        *("--steps", "1", "--batch-size", str(BATCH), "--microbatch-size", str(MICROBATCH), "--data", data),
    )
    logs = [p.log() for p in processes]
    stop_together(processes)
    params = [stage_params(d, 0) for d in dirs]

    assert report["completed"] and report["microbatches_lost"] == 0, report
    assert "contributions are multiplied by 10" in logs[2], logs[2][-2000:]
    clipped = sum(len(re.findall(r"Robust averaging \(clip\) clipped", log)) for log in logs[:3])
    assert clipped >= 1, logs[0][-3000:]  # the liar's parts were clipped where they were reduced
    for other in params[1:]:  # one robust mean, sent to every replica: the liar's state included
        assert_same_params(params[0], other, atol=1e-6)
    initial, reference = one_process_update(data)
    for name, value in params[0].items():
        torch.testing.assert_close(value, reference[name], atol=1e-5, rtol=0, msg=name)
    assert sum(float((value - initial[name]).norm()) for name, value in params[0].items()) > 1e-2  # it stepped


def test_a_member_declaring_a_weight_of_a_million_counts_as_one_in_periodic_averaging():
    """Three real averagers on loopback average parameters as periodic replicas do (weight 1 each,
    no trainer caps, `--robust-averaging clip`); one member declares a weight of 1e6 and sends 0.5
    everywhere (issue #60: such a member set 66.7% of the honest replicas' parameters to 0.5). Its
    weight is capped at the group's median, so the result is the clipped mean of three equal
    senders: within the documented bound of the honest mean, and almost nowhere the liar's value.
    Uncapped, the clip's centre (the coordinate-wise median) is the liar's value wherever it lies
    between the honest ones, and a weight of 1e6 makes the result that centre."""
    import hivemind

    from peers.replicas.averaging_members import MemberAverager

    generator = torch.Generator().manual_seed(0)
    honest = [torch.randn(4096, generator=generator) for _ in range(2)]
    values = [*honest, torch.full((4096,), 0.5)]
    first = hivemind.DHT(start=True)
    dhts = [first, *(hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True) for _ in range(2))]
    averagers = [
        MemberAverager(
            [value.clone()],
            dht,
            robust="clip",
            prefix="million_weight",
            start=True,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            target_group_size=3,
            min_group_size=3,
        )
        for value, dht in zip(values, dhts)
    ]
    try:
        controls = [
            averager.step(weight=weight, gather=weight, wait=False, timeout=60, allow_retries=False)
            for averager, weight in zip(averagers, (1.0, 1.0, 1e6))  # gathered as ReplicaAveraging declares it
        ]
        assert all(control.result(timeout=90) is not None for control in controls)
        results = []
        for averager in averagers[:2]:
            with averager.get_tensors() as (tensor,):
                results.append(tensor.clone())
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
    torch.testing.assert_close(results[0], results[1])  # one result, sent to every member
    at_the_lie = float(((results[0] - 0.5).abs() < 1e-4).float().mean())
    between = float(((honest[0] - 0.5) * (honest[1] - 0.5) < 0).float().mean())
    assert between > 0.3  # where an uncapped 1e6 weight puts the result at the lie (41% of the values on main)
    assert at_the_lie < 0.02, f"{at_the_lie:.1%} of the values are the liar's 0.5"
    honest_mean = (honest[0] + honest[1]) / 2
    spread = (honest[0] - honest[1]).abs().norm()
    # peers/replicas/robust_mean.py: for equal weights, ||result - mu_H|| <= (1 + F) R_H
    assert float((results[0] - honest_mean).norm()) <= (1 + 2.2) * float(spread)
