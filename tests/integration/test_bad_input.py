"""Bad input gets one clear line, never a traceback; a peer refuses a bad tensor and keeps serving.

The refusals run through the fork server (`swarm_cli`: the same `swarm.cli`, without 2 s of imports
each); one first contact starts `python -m swarm.cli` itself, so that output at import is seen too."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import torch

from dht.node import NetworkConfig, start_dht
from models.config import get_model_config
from swarm.trainer.client import PeerCallError, StageClient
from wire.compression import CodecChoice
from wire.failures import Failure
from wire.tensors import encode_tensor

DEAD_BOOTSTRAP = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWFA18rYgnxD833hzMdmuKhUUEfH7Qjj7eSry19gAMGyHS"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m swarm.cli ARGS` in a process of its own, imports and all: a user's first contact."""
    return subprocess.run(
        [sys.executable, "-m", "swarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["peer", "--stage", "five"], ["--stage 'five': expected a stage number or auto"]),
        (["peer", "--faults", "slowdown=fast"], ["--faults slowdown: expected float"]),
        (["peer", "--model", "tiny"], ["no --initial-peers", "swarm dht", "SWARM_INITIAL_PEERS"]),
        (["train", "--model", "tiny", "--data", "/no/such/file.txt"], ["no such file"]),
        (["train", "--model", "tiny", "--batch-size", "10", "--microbatch-size", "4"], ["multiple of"]),
        (["peer", "--model", "tiny", "--stage", "0", "--initial-peers", "not-a-multiaddr"], ["is not a multiaddr"]),
        (["train", "--model", "tiny"], ["no --initial-peers", "swarm dht", "SWARM_INITIAL_PEERS"]),
        (["status", "--model", "tiny"], ["no --initial-peers", "swarm dht"]),
    ],
)
def test_bad_arguments_give_one_line_errors(swarm_cli, args, fragments):
    assert_one_line_error(swarm_cli(*args), *fragments)


def test_a_first_contact_with_a_bad_argument_gives_one_line_error():
    assert_one_line_error(run_cli("peer", "--stage", "five"), "--stage 'five': expected a stage number or auto")


@pytest.mark.slow
@pytest.mark.parametrize("role", ["peer", "train"])
def test_unreachable_bootstrap_gives_one_line_error(swarm_cli, role):
    extra = ["--stage", "0"] if role == "peer" else []
    result = swarm_cli(role, "--model", "tiny", *extra, "--initial-peers", DEAD_BOOTSTRAP, timeout=120)
    assert_one_line_error(result, "could not reach any of the initial peers")


@pytest.mark.slow
def test_peer_refuses_wrong_tensors_and_keeps_serving(make_swarm):
    config = get_model_config("tiny")
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    peer = swarm.start_peer(1)
    swarm.wait_online([peer])
    peer_id = peer.log().split("peer ", 1)[1].split(" ", 1)[0]
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)

    async def scenario():
        p2p = await dht.replicate_p2p()  # the run's own trainer: the peer decodes what it sends
        client = StageClient(
            p2p, model="tiny", num_stages=2, credential=swarm.issue_credential(p2p.peer_id.to_base58())
        )
        targets = torch.randint(0, config.vocab_size, (2, config.seq_len))

        async def backward(inputs):
            tensors = [("inputs", encode_tensor(inputs)), ("targets", encode_tensor(targets))]
            outputs, response, _ = await client.call(
                peer_id,
                rpc="backward",
                stage=1,
                microbatch_id="m",
                batch_size=inputs.shape[0],
                tensors=tensors,
                timeout_s=60,
            )
            return outputs, response

        bad_inputs = [
            (torch.randn(2, config.seq_len, config.d_model + 3), "expects inputs of shape"),
            (torch.randn(2, config.seq_len, config.d_model, dtype=torch.float64), "dtype float32"),
            (torch.full((2, config.seq_len, config.d_model), float("nan")), "NaN"),
        ]
        for inputs, message in bad_inputs:
            with pytest.raises(PeerCallError) as refused:
                await backward(inputs)
            assert refused.value.kind == Failure.REFUSED
            assert message in str(refused.value)
        with pytest.raises(PeerCallError) as wrong_stage:
            await client.call(
                peer_id,
                rpc="forward",
                stage=0,
                microbatch_id="m",
                batch_size=2,
                tensors=[("inputs", encode_tensor(targets))],
                timeout_s=60,
            )
        assert wrong_stage.value.kind == Failure.WRONG_STAGE
        with pytest.raises(PeerCallError, match="unknown response codec 'zstd'"):
            await client.call(
                peer_id,
                rpc="backward",
                stage=1,
                microbatch_id="m",
                batch_size=2,
                tensors=[
                    ("inputs", encode_tensor(torch.randn(2, config.seq_len, config.d_model))),
                    ("targets", encode_tensor(targets)),
                ],
                timeout_s=60,
                response_codec=CodecChoice("zstd"),
            )
        outputs, response = await backward(torch.randn(2, config.seq_len, config.d_model))  # still serving
        assert outputs["grad_inputs"].shape == (2, config.seq_len, config.d_model)
        assert response.loss > 0

    try:
        asyncio.run(scenario())
    finally:
        dht.shutdown()
    assert peer.alive


@pytest.mark.slow
def test_peer_refuses_oversized_requests_and_rate_limits_a_caller_that_keeps_sending_bad_ones(make_swarm):
    config = get_model_config("tiny")
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    peer = swarm.start_peer(
        1,
        "--max-request-mb",
        "0.05",
        "--bad-request-burst",
        "3",
        "--bad-request-refill-per-s",
        "0.01",
        "--metrics-port",
        "0",
    )
    swarm.wait_online([peer])
    peer_id = peer.log().split("peer ", 1)[1].split(" ", 1)[0]
    metrics_url = re.search(r"metrics on (http://\S+)", peer.log()).group(1)
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
    targets = torch.randint(0, config.vocab_size, (2, config.seq_len))

    async def scenario():
        p2p = await dht.replicate_p2p()  # the run's own trainer: the peer decodes what it sends
        client = StageClient(
            p2p, model="tiny", num_stages=2, credential=swarm.issue_credential(p2p.peer_id.to_base58())
        )

        async def backward(inputs):
            tensors = [("inputs", encode_tensor(inputs)), ("targets", encode_tensor(targets))]
            return await client.call(
                peer_id,
                rpc="backward",
                stage=1,
                microbatch_id="m",
                batch_size=inputs.shape[0],
                tensors=tensors,
                timeout_s=60,
            )

        row_bytes = config.seq_len * config.d_model * 4
        assert 2 * row_bytes < 0.05 * (1 << 20) / 2
        await backward(torch.randn(2, config.seq_len, config.d_model))  # well under the limit
        big = torch.randn(int(0.05 * (1 << 20) / row_bytes) + 1, config.seq_len, config.d_model)  # just over it
        with pytest.raises(PeerCallError, match="more than 52428 bytes"):
            await backward(big)
        for _ in range(2):  # the burst of 3 bad requests is spent...
            with pytest.raises(PeerCallError, match="NaN"):
                await backward(torch.full((2, config.seq_len, config.d_model), float("nan")))
        with pytest.raises(PeerCallError, match="too many bad requests") as limited:  # ...so even a good one waits
            await backward(torch.randn(2, config.seq_len, config.d_model))
        assert limited.value.kind == Failure.REFUSED

    try:
        asyncio.run(scenario())
    finally:
        dht.shutdown()
    assert peer.alive
    metrics = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    refused = {
        kind: float(value)
        for kind, value in re.findall(r'swarm_peer_request_failures_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)', metrics)
    }
    assert refused == {"too_large": 1.0, "bad_request": 2.0, "rate_limited": 1.0}, refused
