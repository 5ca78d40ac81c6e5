"""A pipeline without compression computes what one process computes: same loss, same update."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models.config import get_model_config
from models.stages import build_full_model, equal_boundaries, stage_spec
from peers.compute.checkpoint import checkpoint_path, load_checkpoint
from peers.compute.stage_runtime import OptimizerSettings
from swarm.trainer.data import MicrobatchSampler, open_data
from tests.integration.polling import scrape
from tests.integration.processes import stop_together

pytestmark = pytest.mark.slow

BATCH, MICROBATCH = 8, 2


def _first_batch_loss(config, boundaries=None):
    """A fresh one-process model (the peers' initialisation) and its loss on the swarm's first batch."""
    sampler = MicrobatchSampler(
        open_data(None).train, seq_len=config.seq_len, batch_size=BATCH, microbatch_size=MICROBATCH
    )
    microbatches = sampler.batch(0)
    inputs = torch.cat([mb.inputs for mb in microbatches])
    targets = torch.cat([mb.targets for mb in microbatches])
    model = build_full_model(config, boundaries=boundaries)
    return model, model(inputs, targets)


def reference_update(config, kind: str, lr: float, boundaries=None, clip_grad_norm: float | None = None):
    """One process's first step on the swarm's first batch: (loss, parameters by global name); with
    `clip_grad_norm`, the gradient is clipped to that global norm before the step."""
    model, loss = _first_batch_loss(config, boundaries)
    optimizer = OptimizerSettings(optimizer=kind, lr=lr).build(model.parameters())
    loss.backward()
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    optimizer.step()
    return loss.item(), dict(model.named_parameters())


def reference_grad_norm(config, boundaries=None) -> float:
    """The global norm of one process's gradient on the swarm's first batch."""
    model, loss = _first_batch_loss(config, boundaries)
    loss.backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


# cache_size 0: every backward sent without inputs (to the peer that served the forward) misses
# the activation cache, and the trainer must resend it with the inputs. Direct routing: the peers
# pass each microbatch on stage to stage (peers/serving/chain_rpc.py), nothing through the trainer.
# A subspace model (models/subspace.py): K coefficients per token cross between stages, and the
# later stages get the token ids beside them (with the inputs resent on a cache miss, and carried
# hop to hop by direct routing).
# Every call goes over the peers' data plane (wire/data_plane.py, direct TLS), but with `pieces`:
# p2pd only (--no-data-plane), and every hop of direct routing crosses on several streams at once
# (--hop-piece-kb 8: one microbatch of 8 samples, whose 32 KiB of activations and gradient cross in
# 4 pieces each, peers/serving/hop_pieces.py).
@pytest.mark.parametrize(
    ("num_stages", "cache_size", "routing", "subspace"),
    [
        (2, 64, "hub", None),
        (3, 64, "hub", None),
        (3, 0, "hub", None),
        (2, 64, "direct", None),
        (3, 64, "direct pieces", None),
        (3, 0, "hub", "fixed:8"),
        (3, 64, "direct", "fixed:8"),
        (3, 64, "hub", "learned:8"),
    ],
)
def test_one_step_through_the_swarm_matches_one_process(
    make_swarm, tmp_path, num_stages, cache_size, routing, subspace
):
    routing, _, pieces = routing.partition(" ")
    piece_args = ["--hop-piece-kb", "8", "--no-data-plane"] if pieces else []
    microbatch = BATCH if pieces else MICROBATCH
    config = get_model_config("tiny")
    subspace_args = []
    if subspace is not None:
        subspace_kind, rank = subspace.split(":")
        config = dataclasses.replace(config, subspace_kind=subspace_kind, subspace_rank=int(rank))
        subspace_args = ["--subspace-kind", subspace_kind, "--subspace-rank", rank]
    boundaries = equal_boundaries(config.n_layers, num_stages)
    kind, lr = "sgd", 0.5  # SGD: the update is the gradient itself, so a wrong scale would show
    ckpt = str(tmp_path / "ckpt")
    swarm = make_swarm(
        num_stages=num_stages,
        peer_args=[
            *subspace_args,
            "--optimizer",
            kind,
            "--lr",
            str(lr),
            "--target-batch-size",
            str(BATCH),
            "--checkpoint-dir",
            ckpt,
            "--activation-cache-size",
            str(cache_size),
            *piece_args,
        ],
    )
    swarm.start_bootstrap()
    peers = [swarm.start_peer(stage) for stage in range(num_stages)]
    swarm.wait_online(peers)
    report_path = str(tmp_path / "report.json")
    trainer = swarm.start_trainer(
        "--steps",
        "1",
        "--batch-size",
        str(BATCH),
        "--microbatch-size",
        str(microbatch),
        "--num-stages",
        str(num_stages),
        "--report",
        report_path,
        "--routing",
        routing,
        *subspace_args,
        *(["--no-data-plane"] if pieces else []),
    )
    assert trainer.popen.wait(timeout=180) == 0, trainer.log()
    if pieces:  # every later stage took the hop's 3 other pieces (more if a call was made again)
        for stage in range(1, num_stages):
            served = scrape(peers[stage]).get(
                ("swarm_peer_requests_total", (("rpc", "chain_piece"), ("stage", str(stage)))), 0
            )
            assert served >= 3, (stage, served)
    else:  # the trainer's calls, and each chain's hops, went over the data plane
        for stage in range(1, num_stages) if routing == "direct" else ():
            assert served_over(peers[stage], "direct") > 0, stage
    stop_together(peers)  # a clean exit writes each stage's checkpoint
    with open(report_path) as f:
        report = json.load(f)
    if pieces:
        assert set(report["transports"]) == {"p2pd"}, report["transports"]
    else:
        assert report["transports"]["direct"]["calls"] > 0, report["transports"]

    ref_loss, ref_params = reference_update(config, kind, lr, boundaries)
    assert report["losses"][0] == pytest.approx(ref_loss, abs=1e-5)
    assert report["microbatches_lost"] == 0
    backwards_with_cache = (BATCH // MICROBATCH) * (num_stages - 1)  # the last stage's fused call needs its inputs
    if routing == "direct":  # no backward call from the trainer at all: one chained call per microbatch
        assert (report["backward_inputs_skipped"], report["backward_inputs_resent"]) == (0, 0)
        # A call that broke in transit or timed out under load is driven again (once seen in CI, on 2
        # busy cores): the sums above still match one process. Any other failure is a bug.
        transient = {"transport", "timeout"}
        assert report["microbatches_retried"] == 0 or set(report["failures_by_kind"]) <= transient, (
            report,
            trainer.log(),
        )
    elif cache_size:
        assert (report["backward_inputs_skipped"], report["backward_inputs_resent"]) == (backwards_with_cache, 0)
    else:
        assert (report["backward_inputs_skipped"], report["backward_inputs_resent"]) == (0, backwards_with_cache)
    initial = dict(build_full_model(config, boundaries=boundaries).named_parameters())
    compared = 0
    for stage in range(num_stages):
        meta, state, _ = load_checkpoint(checkpoint_path(ckpt, "tiny", stage, num_stages))
        assert meta.steps_done == 1
        spec = stage_spec(config, stage, num_stages)
        for name, value in state.items():
            name = full_model_name(name, spec)
            torch.testing.assert_close(value, ref_params[name].detach(), atol=1e-5, rtol=0)
            assert not torch.equal(value, initial[name].detach()), f"{name} did not change"
            compared += 1
    assert compared == len(ref_params)


def served_over(peer, transport: str, rpc: str | None = None) -> float:
    """Streamed calls (of `rpc`, or any) `peer` served over `transport` ("direct": its data plane, or "p2pd")."""
    return sum(
        value
        for (name, labels), value in scrape(peer).items()
        if name == "swarm_peer_transport_calls_total"
        and {("side", "served"), ("transport", transport)} <= set(labels)
        and (rpc is None or ("rpc", rpc) in labels)
    )


def full_model_name(name: str, spec) -> str:
    """A stage's parameter name as the whole model names it (its blocks are numbered from 0)."""
    if name.startswith("blocks."):
        index = int(name.split(".")[1]) + spec.first_layer
        return f"blocks.{index}." + name.split(".", 2)[2]
    return name
