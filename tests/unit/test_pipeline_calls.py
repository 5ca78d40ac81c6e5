"""SwarmPipeline.call_stage against a scripted client: backward without inputs, the cache-miss
resend, and encodings passed on as received. No network, no DHT."""

from __future__ import annotations

import asyncio

import torch

from swarm.trainer.client import CallResult, PeerCallError
from swarm.trainer.pipeline import SwarmPipeline
from swarm.trainer.routing import ReplicaInfo
from wire.failures import Failure
from wire.protocol import ResponseHeader
from wire.tensors import encode_tensor

B, T, D = 2, 8, 4


class ScriptedClient:
    """Answers every call with a well-formed gradient; `missing` peers answer a cache miss to a
    backward sent without inputs."""

    def __init__(self, missing: set[str] = frozenset()):
        self.missing, self.calls = missing, []

    async def exchange(
        self, peer_id, *, rpc, stage, microbatch_id, batch_size, tensors, timeout_s, response_codec, inputs_cached=False
    ):
        self.calls.append({"peer": peer_id, "rpc": rpc, "tensors": dict(tensors), "inputs_cached": inputs_cached})
        if inputs_cached and peer_id in self.missing:
            raise PeerCallError(peer_id, Failure.CACHE_MISS, "nothing cached")
        grad = torch.ones(batch_size, T, D)
        encoded = encode_tensor(grad)
        return CallResult({"grad_inputs": grad}, {"grad_inputs": encoded}, ResponseHeader(compute_s=0.01), 100)


def make_pipeline(client, peers=("peer-a",)) -> SwarmPipeline:
    pipeline = SwarmPipeline(
        None,
        client,
        model="tiny",
        num_stages=3,
        d_model=D,
        seq_len=T,
        max_retries=2,
        stage_wait_timeout_s=1.0,
        max_in_flight=1,
        run_id="run",
    )
    for scheduler in pipeline.schedulers:
        scheduler.update_replicas([ReplicaInfo(p, 10.0) for p in peers])
    return pipeline


def backward(pipeline, *, cached_on, encoded=None):
    tensors = [("inputs", torch.randn(B, T, D)), ("grad_outputs", torch.randn(B, T, D))]
    return asyncio.run(pipeline.call_stage(1, "backward", "mb", B, tensors, encoded=encoded, cached_on=cached_on))


def test_backward_to_the_forward_replica_sends_no_inputs():
    client = ScriptedClient()
    pipeline = make_pipeline(client)
    answer = backward(pipeline, cached_on="peer-a")
    assert [(c["inputs_cached"], sorted(c["tensors"])) for c in client.calls] == [(True, ["grad_outputs"])]
    assert answer.peer_id == "peer-a" and pipeline.counters.backward_inputs_skipped == 1


def test_backward_elsewhere_sends_the_inputs():
    client = ScriptedClient()
    backward(make_pipeline(client), cached_on="peer-gone")
    assert [(c["inputs_cached"], sorted(c["tensors"])) for c in client.calls] == [(False, ["grad_outputs", "inputs"])]


def test_a_cache_miss_is_resent_with_inputs_to_the_same_peer_without_a_ban():
    client = ScriptedClient(missing={"peer-a"})
    pipeline = make_pipeline(client)
    answer = backward(pipeline, cached_on="peer-a")
    assert [(c["peer"], c["inputs_cached"], "inputs" in c["tensors"]) for c in client.calls] == [
        ("peer-a", True, False),
        ("peer-a", False, True),
    ]
    assert answer.peer_id == "peer-a"
    assert (pipeline.counters.backward_inputs_skipped, pipeline.counters.backward_inputs_resent) == (0, 1)
    assert pipeline.counters.calls_retried == 0 and not pipeline.bans.banned()


def test_an_encoding_received_earlier_is_sent_on_as_it_is():
    client = ScriptedClient()
    pipeline = make_pipeline(client)
    received = encode_tensor(torch.randn(B, T, D))
    backward(pipeline, cached_on="peer-a", encoded={("grad_outputs", "none", ()): received})
    assert client.calls[0]["tensors"]["grad_outputs"] is received
