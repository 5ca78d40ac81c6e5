"""StageCaller.call and StepSchedule against scripted clients: backward without inputs, the
cache-miss resend, and encodings passed on as received. No network, no DHT."""

from __future__ import annotations

import asyncio

import torch

from dht.records import PeerRecord, PeerState
from swarm.trainer.client import CallResult, PeerCallError
from swarm.trainer.config import FailoverSettings
from swarm.trainer.data import Microbatch
from swarm.trainer.discovery import SwarmView
from swarm.trainer.routing import ReplicaInfo
from swarm.trainer.schedule import StepSchedule
from swarm.trainer.stage_call import Payload, StageCaller
from wire.failures import Failure
from wire.protocol import CommitResponse, ResponseHeader
from wire.tensors import encode_tensor

B, T, D = 2, 8, 4


class ScriptedClient:
    """Answers every call with a well-formed gradient; `missing` peers answer a cache miss to a
    backward sent without inputs."""

    def __init__(self, missing: set[str] = frozenset()):
        self.missing, self.calls = missing, []

    async def exchange(
        self,
        peer_id,
        *,
        rpc,
        stage,
        microbatch_id,
        batch_size,
        tensors,
        timeout_s,
        response_codec,
        inputs_cached=False,
        evaluate=False,
        max_answer_bytes=None,
        grad_sample=False,
    ):
        self.calls.append({"peer": peer_id, "rpc": rpc, "tensors": dict(tensors), "inputs_cached": inputs_cached})
        if inputs_cached and peer_id in self.missing:
            raise PeerCallError(peer_id, Failure.CACHE_MISS, "nothing cached")
        grad = torch.ones(batch_size, T, D)
        encoded = encode_tensor(grad)
        return CallResult({"grad_inputs": grad}, {"grad_inputs": encoded}, ResponseHeader(compute_s=0.01), 100)


def make_caller(client, peers=("peer-a",)) -> StageCaller:
    view = SwarmView(None, model="tiny", num_stages=3)
    caller = StageCaller(
        view, client, d_model=D, seq_len=T, failover=FailoverSettings(max_retries=2, stage_wait_timeout_s=1.0)
    )
    for scheduler in view.schedulers:
        scheduler.update_replicas([ReplicaInfo(p, 10.0) for p in peers])
    return caller


def backward(caller, *, cached_on, grad_encodings=None):
    grad_outputs = Payload(torch.randn(B, T, D), dict(grad_encodings or {}))
    tensors = [("inputs", Payload(torch.randn(B, T, D))), ("grad_outputs", grad_outputs)]
    return asyncio.run(caller.call(1, "backward", "mb", B, tensors, cached_on=cached_on))


def test_backward_to_the_forward_replica_sends_no_inputs():
    client = ScriptedClient()
    caller = make_caller(client)
    answer = backward(caller, cached_on="peer-a")
    assert [(c["inputs_cached"], sorted(c["tensors"])) for c in client.calls] == [(True, ["grad_outputs"])]
    assert answer.peer_id == "peer-a" and caller.counters.backward_inputs_skipped == 1


def test_backward_elsewhere_sends_the_inputs():
    client = ScriptedClient()
    backward(make_caller(client), cached_on="peer-gone")
    assert [(c["inputs_cached"], sorted(c["tensors"])) for c in client.calls] == [(False, ["grad_outputs", "inputs"])]


def test_a_cache_miss_is_resent_with_inputs_to_the_same_peer_without_a_ban():
    client = ScriptedClient(missing={"peer-a"})
    caller = make_caller(client)
    answer = backward(caller, cached_on="peer-a")
    assert [(c["peer"], c["inputs_cached"], "inputs" in c["tensors"]) for c in client.calls] == [
        ("peer-a", True, False),
        ("peer-a", False, True),
    ]
    assert answer.peer_id == "peer-a"
    assert (caller.counters.backward_inputs_skipped, caller.counters.backward_inputs_resent) == (0, 1)
    assert caller.counters.calls_retried == 0 and not caller.view.bans.banned()


def test_an_encoding_received_earlier_is_sent_on_as_it_is():
    client = ScriptedClient()
    caller = make_caller(client)
    received = encode_tensor(torch.randn(B, T, D))
    backward(caller, cached_on="peer-a", grad_encodings={("none", ()): received})
    assert client.calls[0]["tensors"]["grad_outputs"] is received


class ScriptedStages:
    """Every stage answers as a healthy peer would: forwards return activations, the last stage's
    backward a loss and gradients, stage 0's backward nothing. Backwards sent without inputs find
    no cached forward, so the inputs are sent again."""

    def __init__(self, num_stages: int):
        self.num_stages, self.calls, self.returned = num_stages, [], []

    async def exchange(
        self,
        peer_id,
        *,
        rpc,
        stage,
        microbatch_id,
        batch_size,
        tensors,
        timeout_s,
        response_codec,
        inputs_cached=False,
        evaluate=False,
        max_answer_bytes=None,
        grad_sample=False,
    ):
        self.calls.append(
            {"stage": stage, "rpc": rpc, "tensors": dict(tensors), "inputs_cached": inputs_cached, "evaluate": evaluate}
        )
        if inputs_cached:
            self.returned.append({})
            raise PeerCallError(peer_id, Failure.CACHE_MISS, "nothing cached")
        name = "outputs" if rpc == "forward" else "grad_inputs"
        outputs = {} if rpc == "backward" and stage == 0 else {name: torch.randn(batch_size, T, D)}
        loss = 2.5 if stage == self.num_stages - 1 else None
        encoded = {n: encode_tensor(t) for n, t in outputs.items()}
        self.returned.append(encoded)
        return CallResult(outputs, encoded, ResponseHeader(loss=loss, compute_s=0.01), 100)


def test_a_microbatch_goes_forward_and_back_passing_encodings_on_as_received():
    client = ScriptedStages(num_stages=3)
    caller = make_caller(client, peers=("peer-a",))
    schedule = StepSchedule(caller, max_in_flight=2, run_id="run", routing="hub")
    inputs = torch.randint(0, 10, (B, T))
    loss = asyncio.run(schedule.run_step([Microbatch(step=0, index=0, inputs=inputs, targets=inputs)]))
    assert loss == 2.5
    calls = [(c["stage"], c["rpc"], c["inputs_cached"]) for c in client.calls]
    assert calls == [
        (0, "forward", False),
        (1, "forward", False),
        (2, "backward", False),  # the last stage: forward and backward in one call, with the targets
        (1, "backward", True),
        (1, "backward", False),  # a cache miss: resent with the inputs
        (0, "backward", True),
        (0, "backward", False),
    ]
    sent, returned = [c["tensors"] for c in client.calls], client.returned
    assert sorted(sent[2]) == ["inputs", "targets"]
    # what one stage sent back is sent on to the next as it came, not decoded and encoded again
    assert sent[1]["inputs"] is returned[0]["outputs"] and sent[2]["inputs"] is returned[1]["outputs"]
    assert sent[3]["grad_outputs"] is sent[4]["grad_outputs"] is returned[2]["grad_inputs"]
    assert sent[5]["grad_outputs"] is sent[6]["grad_outputs"] is returned[4]["grad_inputs"]
    # a backward that resends its inputs sends the encoding made for (or received before) the forward
    assert sent[6]["inputs"] is sent[0]["inputs"] and sent[4]["inputs"] is sent[1]["inputs"]
    assert (schedule.counters.microbatches_sent, schedule.counters.microbatches_done) == (1, 1)
    assert caller.counters.backward_inputs_resent == 2 and caller.counters.calls_retried == 0


def test_an_evaluation_goes_forward_only_and_asks_every_stage_to_keep_nothing():
    client = ScriptedStages(num_stages=3)
    caller = make_caller(client, peers=("peer-a",))
    schedule = StepSchedule(caller, max_in_flight=2, run_id="run", routing="hub")
    inputs = torch.randint(0, 10, (B, T))
    batches = [[Microbatch(step=-1, index=i, inputs=inputs, targets=inputs) for i in range(2)]]
    assert asyncio.run(schedule.evaluate(batches)) == 2.5
    calls = [(c["stage"], c["rpc"], c["evaluate"], sorted(c["tensors"])) for c in client.calls]
    assert sorted(calls) == sorted(
        [
            (0, "forward", True, ["inputs"]),
            (1, "forward", True, ["inputs"]),
            (2, "forward", True, ["inputs", "targets"]),
        ]
        * 2
    )
    assert schedule.counters.commits == 0 and schedule.counters.microbatches_sent == 0  # nothing trained


class CommitClient(ScriptedClient):
    """Answers commits as a replica that stepped and averaged; the `dead` ones' streams fail."""

    def __init__(self, dead: set[str]):
        super().__init__()
        self.dead, self.committed = dead, []

    async def commit(self, peer_id, *, stage, step_id, group_size, timeout_s, **kw):
        self.committed.append((step_id, peer_id, group_size))
        if peer_id in self.dead:
            raise PeerCallError(peer_id, Failure.TRANSPORT, "connection refused")
        return CommitResponse(stepped=True, averaged=True, group_size=group_size)


def stage_records(peers: tuple[str, ...], *, averaging: str) -> list[PeerRecord]:
    """Online records of stage 0 for `peers`, each expiring at 100 s."""
    return [
        PeerRecord(
            peer_id=p,
            model="tiny",
            stage=0,
            num_stages=3,
            state=PeerState.ONLINE,
            throughput=10.0,
            expires_at=100.0,
            averaging=averaging,
        )
        for p in peers
    ]


def test_a_replica_whose_commit_failed_is_left_out_of_commits_until_its_record_is_renewed():
    """A replica killed mid-run keeps its record until it expires: the commits after a failed one
    leave it out (its group's rounds would wait for it and fail), and take it again once the
    replica renews its record (it is alive)."""
    client = CommitClient(dead={"dead"})
    caller = make_caller(client, peers=("a", "b", "dead"))
    records = stage_records(("a", "b", "dead"), averaging="outer")
    caller.view.records[0] = records
    schedule = StepSchedule(caller, max_in_flight=2, run_id="run", routing="hub")

    def commit(step_id: str) -> list[tuple[str, int]]:
        asyncio.run(schedule.commit_step(step_id, timeout_s=1.0))
        return sorted((peer, size) for step, peer, size in client.committed if step == step_id)

    assert commit("s1") == [("a", 3), ("b", 3), ("dead", 3)]
    assert commit("s2") == [("a", 2), ("b", 2)]  # its record was not renewed since
    caller.view.records[0] = [*records[:2], records[2].model_copy(update={"expires_at": 115.0})]
    client.dead = set()
    assert commit("s3") == [("a", 3), ("b", 3), ("dead", 3)]  # renewed: alive again


def test_a_replica_that_never_answered_and_timed_out_is_left_out_of_commits_until_it_answers():
    """Issue #60: a sybil cut on probation (banned for a second or two, one stall strike) that was
    then committed held the commit, and its group's averaging round, to their deadlines (120 s and
    30 s, twice a run). It is left out while it has not answered; an answer brings it back."""
    client = CommitClient(dead=set())
    caller = make_caller(client, peers=("a", "b", "new"))
    caller.view.records[0] = stage_records(("a", "b", "new"), averaging="sync")
    schedule = StepSchedule(caller, max_in_flight=2, run_id="run", routing="hub")
    for peer_id in ("a", "b"):
        caller.engine.note_answered(peer_id, 0, "backward", 2)

    def commit(step_id: str) -> list[tuple[str, int]]:
        asyncio.run(schedule.commit_step(step_id, timeout_s=1.0))
        return sorted((peer, size) for step, peer, size in client.committed if step == step_id)

    assert commit("s1") == [("a", 3), ("b", 3), ("new", 3)]  # not called yet: committed as any replica
    caller.view.bans.ban("new", at_least_s=1.5, timed_out=True)  # what a probation cut does (call_engine.py)
    assert commit("s2") == [("a", 2), ("b", 2)]
    caller.engine.note_answered("new", 0, "backward", 2)
    assert commit("s3") == [("a", 3), ("b", 3), ("new", 3)]
