"""Outer rounds between real peers (`--averaging outer`): replicas that step alone and exchange
compressed pseudo-gradients every few steps end each round agreeing; a replica killed mid-round
loses the others nothing; a joiner that arrives mid-period ends equal to the others after the
next round."""

from __future__ import annotations

import re

import pytest
import torch

from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from peers.compute.stage_runtime import REPLICA_STATE_KEY
from tests.integration.polling import scrape
from tests.integration.processes import stop_together
from tests.integration.test_replicas import assert_same_params, averaging_sample, run_trainer, stage_params

pytestmark = pytest.mark.slow

TRAIN = ["--batch-size", "8", "--microbatch-size", "2"]


def outer_args(*extra: str) -> list[str]:
    return ["--averaging", "outer", "--averaging-every-steps", "2", *extra]


def saved_anchors(ckpt_dir) -> list[torch.Tensor]:
    optimizer_state = load_checkpoint(checkpoint_path(str(ckpt_dir), "tiny", 0, 2))[2]
    return optimizer_state[REPLICA_STATE_KEY]["anchors"]


def rounds_logged(peer) -> list[tuple[str, str]]:
    return re.findall(r"outer round with 1 other replica\(s\) \(rounds applied (\d+); (\d+) steps done\)", peer.log())


@pytest.mark.parametrize(
    "extra, logged",
    [
        (["--outer-codec", "int8"], [("1", "2"), ("2", "4")]),
        (["--outer-codec", "topk", "--outer-topk-fraction", "0.1", "--outer-overlap"], [("1", "4")]),
    ],
    ids=["int8", "topk-overlapped"],
)
def test_outer_replicas_agree_after_each_round(make_swarm, tmp_path, extra, logged):
    """Rounds after steps 2 and 4: without overlap each is applied at once, and the replicas end
    with equal parameters and anchors; overlapped, the round of step 2 is applied at step 4 and that
    of step 4 at the trainer's flush, so they end equal too. Bytes: a round's payload each way."""
    swarm = make_swarm(num_stages=2, peer_args=["--lr", "3e-3"])
    swarm.start_bootstrap()
    replicas = [
        swarm.start_peer(0, *outer_args(*extra), "--checkpoint-dir", str(tmp_path / name), name=f"replica-{name}")
        for name in ("a", "b")
    ]
    last = swarm.start_peer(1)
    swarm.wait_online([*replicas, last])
    run_trainer(swarm, tmp_path, "--steps", "4", *TRAIN)
    for peer in replicas:
        assert rounds_logged(peer) == logged, peer.log()[-3000:]
    sent = [
        averaging_sample(scrape(p), "swarm_peer_averaging_bytes_total", mode="outer", direction="sent")
        for p in replicas
    ]
    stop_together(replicas)
    a, b = stage_params(tmp_path / "a", 0), stage_params(tmp_path / "b", 0)
    assert_same_params(a, b, atol=0.0)
    for x, y in zip(saved_anchors(tmp_path / "a"), saved_anchors(tmp_path / "b")):
        assert torch.equal(x, y)
    values = sum(t.numel() for t in a.values())
    per_value = 1.1 if "int8" in extra else 0.1 * 6 + 0.01
    assert all(0 < s <= 2 * per_value * values for s in sent), (sent, values)
