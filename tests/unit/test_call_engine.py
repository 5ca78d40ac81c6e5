"""The trainer's one call engine (swarm/trainer/call_engine.py) driving both routings, against
scripted clients: no network, no DHT; the view, the counters, the ledger and the ban lists are the
real ones. A chained call that failed is blamed on each hop it failed over from (counted by kind,
routed around) and on the replicas of the stage that failed it; a chain whose first stream broke is
driven again along the same route; a hub backward lost in transit is asked of the same replica
again; both write the one set of counters; a budget spent waits for the swarm and gives up loudly."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarm.trainer.chain_call import CHAIN_TIMEOUT_KEY, ChainCaller
from swarm.trainer.client import CallResult, ChainCallError, ChainResult, PeerCallError
from swarm.trainer.config import FailoverSettings
from swarm.trainer.data import Microbatch
from swarm.trainer.discovery import SwarmView
from swarm.trainer.failures import NotAllowedError, StageUnavailableError, TimeoutPolicy
from swarm.trainer.routing import ReplicaInfo
from swarm.trainer.schedule import StepSchedule
from swarm.trainer.stage_call import Payload, StageCaller
from wire.failures import Failure
from wire.protocol import HopFailover, ResponseHeader
from wire.tensors import encode_tensor

B, T, D = 2, 8, 4
ROUTE_PEERS = [["a0"], ["b0", "b1"], ["c0", "c1"]]


class ScriptedClient:
    """Raises the scripted errors in turn, then answers: chains with a loss, hub calls with a gradient."""

    def __init__(self, errors=(), failed_over=()):
        self.errors, self.failed_over, self.calls = list(errors), list(failed_over), []
        self.p2p = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "trainer"))

    async def train_chain(self, peer_id, *, route, **kwargs):
        self.calls.append([[peer_id], *route])
        if self.errors:
            raise self.errors.pop(0)
        served_by = [peer_id, *(candidates[0] for candidates in route)]
        return ChainResult(2.0, served_by, self.failed_over, 100)

    async def exchange(self, peer_id, *, rpc, stage, batch_size, inputs_cached=False, **kwargs):
        self.calls.append((peer_id, rpc, inputs_cached))
        if self.errors:
            raise self.errors.pop(0)
        grad = torch.ones(batch_size, T, D)
        return CallResult({"grad_inputs": grad}, {"grad_inputs": encode_tensor(grad)}, ResponseHeader(), 100)


def make_caller(client, *, max_retries=3, stage_wait_timeout_s=0.0) -> StageCaller:
    view = SwarmView(None, model="tiny", num_stages=3)
    caller = StageCaller(
        view,
        client,
        d_model=D,
        seq_len=T,
        failover=FailoverSettings(max_retries=max_retries, stage_wait_timeout_s=stage_wait_timeout_s),
        say=lambda line: None,
    )
    for scheduler, peers in zip(view.schedulers, ROUTE_PEERS):
        scheduler.update_replicas([ReplicaInfo(p, 10.0 - i) for i, p in enumerate(peers)])

    async def no_refresh():
        return None

    view.refresh = no_refresh
    return caller


def microbatch() -> Microbatch:
    inputs = torch.zeros(B, T, dtype=torch.long)
    return Microbatch(step=0, index=0, inputs=inputs, targets=inputs)


def drive_chain(caller: StageCaller) -> tuple[object, list[str]]:
    failures: list[str] = []
    answer = asyncio.run(ChainCaller(caller).run("mb", microbatch(), failures))
    return answer, failures


def failed_calls(caller: StageCaller) -> dict[str, tuple[int, int]]:
    return {p: (c["stage"], c["calls_failed"]) for p, c in caller.contributions.snapshot().items() if c["calls_failed"]}


def observed_failures(caller: StageCaller) -> dict[tuple[str, str, str], float]:
    samples = caller.metrics.registry.get_sample_value
    return {
        (stage, rpc, kind): samples("swarm_trainer_call_failures_total", {"stage": stage, "rpc": rpc, "kind": kind})
        for stage, rpc, kind in [
            ("1", "train_chain", "garbage"),
            ("2", "train_chain", "timeout"),
            ("2", "train_chain", "transport"),
            ("0", "train_chain", "transport"),
        ]
    }


def test_a_chain_that_failed_at_a_later_stage_blames_every_hop_it_failed_over_from_once():
    error = ChainCallError(
        "a0",
        Failure.INTERNAL,
        "stage 2: no candidate of the route answered",
        stage=2,
        failed_peers=["c0", "c1"],
        failovers=[
            HopFailover(peer="b0", stage=1, kind=Failure.GARBAGE),  # stage 1 failed over to b1 first
            HopFailover(peer="c0", stage=2, kind=Failure.TIMEOUT),
            HopFailover(peer="c1", stage=2, kind=Failure.TRANSPORT),
            HopFailover(peer="zz", stage=1, kind=Failure.GARBAGE),  # not in the route: not counted
        ],
    )
    client = ScriptedClient([error])
    caller = make_caller(client)
    # the route is chosen again without the replicas that failed: c0 and c1 are banned and excluded,
    # and stage 2 has no replica left, so the engine waits and gives up (stage_wait_timeout_s 0)
    with pytest.raises(StageUnavailableError):
        drive_chain(caller)
    counters = caller.counters
    assert counters.calls_retried == 1  # one microbatch driven again
    assert counters.failures_by_kind == {"garbage": 1, "timeout": 1, "transport": 1}
    assert failed_calls(caller) == {"b0": (1, 1), "c0": (2, 1), "c1": (2, 1)}  # each once, not twice
    assert caller.view.bans.banned() == {"b0", "c0", "c1"}
    assert observed_failures(caller) == {
        ("1", "train_chain", "garbage"): 1.0,
        ("2", "train_chain", "timeout"): 1.0,
        ("2", "train_chain", "transport"): 1.0,
        ("0", "train_chain", "transport"): None,
    }


def test_a_chain_whose_first_stream_broke_is_driven_again_along_the_same_route_and_counted_once():
    broke = ChainCallError("a0", Failure.TRANSPORT, "the stream broke", stage=0, failed_peers=["a0"])
    client = ScriptedClient([broke])
    caller = make_caller(client)
    answer, failures = drive_chain(caller)
    assert answer.served_by == ["a0", "b0", "c0"] and len(failures) == 1
    assert client.calls[0] == client.calls[1]  # the same route, though a0 was banned after the failure
    counters = caller.counters
    assert (counters.backward_asked_again, counters.calls_retried, counters.failures_by_kind) == (
        1,
        1,
        {"transport": 1},
    )
    assert failed_calls(caller) == {"a0": (0, 1)}
    assert not caller.view.bans.banned()  # its answer lifted the ban
    assert counters.calls_by_peer == {"a0": 1, "b0": 1, "c0": 1}


def test_a_chain_timeout_goes_to_another_route_the_hang_may_be_below():
    timed_out = ChainCallError("a0", Failure.TIMEOUT, "took too long", stage=0, failed_peers=["a0"])
    client = ScriptedClient([timed_out])
    caller = make_caller(client)
    caller.view.schedulers[0].update_replicas([ReplicaInfo("a0", 10.0), ReplicaInfo("a1", 9.0)])
    answer, _ = drive_chain(caller)
    assert answer.served_by[0] == "a1" and caller.counters.backward_asked_again == 0


def test_hops_that_failed_over_inside_a_chain_that_answered_are_counted_and_routed_around():
    client = ScriptedClient(failed_over=[HopFailover(peer="b1", stage=1, kind=Failure.TIMEOUT)])
    caller = make_caller(client)
    _, failures = drive_chain(caller)
    assert len(failures) == 1 and caller.counters.calls_retried == 1
    assert caller.counters.failures_by_kind == {"timeout": 1}
    assert failed_calls(caller) == {"b1": (1, 1)} and caller.view.bans.banned() == {"b1"}


def test_a_hub_backward_lost_in_transit_is_asked_of_the_same_replica_again_in_the_same_counters():
    client = ScriptedClient([PeerCallError("b0", Failure.TIMEOUT, "no answer")])
    caller = make_caller(client)
    caller.view.schedulers[1].update_replicas([ReplicaInfo("b0", 10.0), ReplicaInfo("b1", 10.0)])
    tensors = [("inputs", Payload(torch.randn(B, T, D))), ("grad_outputs", Payload(torch.randn(B, T, D)))]
    answer = asyncio.run(caller.call(1, "backward", "mb", B, tensors, cached_on="b0"))
    # asked again: with its inputs (the failed call may have taken them out of its cache)
    assert client.calls == [("b0", "backward", True), ("b0", "backward", False)] and answer.peer_id == "b0"
    schedule = StepSchedule(caller, max_in_flight=1, run_id="run")
    assert schedule.counters is caller.counters  # one set of counters for the calls and the schedule
    assert (caller.counters.backward_asked_again, caller.counters.calls_retried) == (1, 1)


def test_a_spent_budget_waits_for_the_swarm_and_then_gives_up_loudly():
    errors = [PeerCallError("b0", Failure.INTERNAL, "failed")] * 10
    caller = make_caller(ScriptedClient(errors), max_retries=0)
    caller.view.bans.ban = lambda peer_id, at_least_s=0.0, **_: 0.0  # nobody banned: the budget stops it
    with pytest.raises(StageUnavailableError, match="no live replica"):
        asyncio.run(caller.call(1, "forward", "mb", B, [("inputs", Payload(torch.randn(B, T, D)))]))


def test_a_swarm_that_shuts_us_out_stops_the_run_with_what_to_do():
    refused = PeerCallError("b0", Failure.REFUSED, "not authorized: this trainer holds no credential")
    caller = make_caller(ScriptedClient([refused]))
    caller.view.schedulers[1].update_replicas([ReplicaInfo("b0", 10.0)])
    with pytest.raises(NotAllowedError, match="swarm run issue"):
        asyncio.run(caller.call(1, "forward", "mb", B, [("inputs", Payload(torch.randn(B, T, D)))]))
    assert caller.counters.calls_retried == 0 and caller.not_allowed_by == {"b0": "b0"}


class StallingClient(ScriptedClient):
    """Chains through `stalling` at stage 1 answer only after `stall_s`; the others at once."""

    def __init__(self, stalling: str, stall_s: float):
        super().__init__()
        self.stalling, self.stall_s = stalling, stall_s

    async def train_chain(self, peer_id, *, route, **kwargs):
        if route[0][0] == self.stalling:
            await asyncio.sleep(self.stall_s)
        return await super().train_chain(peer_id, route=route, **kwargs)


def on_probation(caller: StageCaller, proven: list[tuple[int, str]]) -> StageCaller:
    """`caller` with a short probation floor, a chain of 10 ms seen, and `proven` replicas that answered."""
    caller.engine.timeouts = TimeoutPolicy(probation_floor_s=0.05)
    caller.engine.timeouts.observe(*CHAIN_TIMEOUT_KEY, 0.01)
    for stage, peer_id in proven:
        caller.engine.note_answered(peer_id, stage, "backward", B)
    return caller


def test_a_replica_that_never_answered_is_cut_on_probation_once_its_stage_has_one_that_did():
    """Issue #60: sybils present from the first step held it for the timeout's 5 s floor. b0 (the
    preferred replica of stage 1) never answered and stalls while b1 has answered: the chain is cut
    after its probation (3 x the 10 ms seen, at least 50 ms here), b0 is banned briefly with one
    stall strike (not for long: an honest newcomer may be slow once), and the microbatch is driven
    again through b1, which answered before, not through b01, the next newcomer (first by peer id)."""
    client = StallingClient("b0", stall_s=3.0)
    caller = on_probation(make_caller(client), [(0, "a0"), (1, "b1"), (2, "c0"), (2, "c1")])
    caller.view.schedulers[1].update_replicas(
        [ReplicaInfo(p, speed) for p, speed in (("b0", 10.0), ("b01", 9.5), ("b1", 9.0))]
    )
    answer, failures = drive_chain(caller)
    assert answer.served_by[:2] == ["a0", "b1"] and len(failures) == 1, failures
    assert "probation" in failures[0]
    assert caller.counters.calls_cut_on_probation == 1 and caller.counters.failures_by_kind == {"timeout": 1}
    assert failed_calls(caller) == {"b0": (1, 1)}  # blamed on b0 alone, not on a0 that was called
    bans = caller.view.bans
    assert bans.banned() == {"b0"} and not bans.stalled("b0")
    assert bans.ban("b0", timed_out=True) > 0 and bans.is_banned("b0")  # the same incident: no second strike yet


def test_no_probation_while_no_other_replica_of_the_stage_answered():
    """The first calls of a run, or a stage whose replicas are all new: nothing to compare with, and
    nowhere proven to go. The slow call is waited for (under the adaptive timeout only)."""
    client = StallingClient("b0", stall_s=0.3)
    caller = on_probation(make_caller(client), [(0, "a0"), (2, "c0"), (2, "c1")])
    answer, failures = drive_chain(caller)
    assert answer.served_by == ["a0", "b0", "c0"] and not failures
    assert caller.counters.calls_cut_on_probation == 0 and not caller.view.bans.banned()


def test_a_hub_call_to_a_replica_that_never_answered_is_cut_on_probation_too():
    class StallingHub(ScriptedClient):
        async def exchange(self, peer_id, **kwargs):
            if peer_id == "b0":
                await asyncio.sleep(3.0)
            self.calls.append(peer_id)
            outputs = torch.ones(B, T, D)
            return CallResult({"outputs": outputs}, {"outputs": encode_tensor(outputs)}, ResponseHeader(), 100)

    caller = make_caller(StallingHub())
    caller.engine.timeouts = TimeoutPolicy(probation_floor_s=0.05)
    caller.engine.timeouts.observe(1, "forward", 0.01)
    caller.engine.note_answered("b1", 1, "forward", B)
    caller.view.schedulers[1].update_replicas([ReplicaInfo("b0", 10.0), ReplicaInfo("b1", 9.0)])
    answer = asyncio.run(caller.call(1, "forward", "mb", B, [("inputs", Payload(torch.randn(B, T, D)))]))
    assert answer.peer_id == "b1" and caller.counters.calls_cut_on_probation == 1
    assert caller.view.bans.banned() == {"b0"} and caller.client.calls == ["b1"]


def test_a_call_that_adds_work_cut_on_probation_is_not_asked_of_the_same_replica_again():
    """A hub backward timed out is asked of the same replica again (its answer may be lost, and another
    replica would add its gradients twice); one cut on probation is not: the repeat would be cut the
    same way, 0.5 s later, while the replica is banned, and so never earn its second stall strike."""

    class StallingHub(ScriptedClient):
        async def exchange(self, peer_id, *, rpc, stage, batch_size, inputs_cached=False, **kwargs):
            if peer_id == "b0":
                await asyncio.sleep(3.0)
            return await super().exchange(peer_id, rpc=rpc, stage=stage, batch_size=batch_size, inputs_cached=False)

    caller = make_caller(StallingHub())
    caller.engine.timeouts = TimeoutPolicy(probation_floor_s=0.05)
    caller.engine.timeouts.observe(1, "backward", 0.01)
    caller.engine.note_answered("b1", 1, "backward", B)
    caller.view.schedulers[1].update_replicas([ReplicaInfo("b0", 10.0), ReplicaInfo("b1", 9.0)])
    tensors = [("inputs", Payload(torch.randn(B, T, D))), ("grad_outputs", Payload(torch.randn(B, T, D)))]
    answer = asyncio.run(caller.call(1, "backward", "mb", B, tensors))
    assert answer.peer_id == "b1" and caller.counters.calls_cut_on_probation == 1
    assert caller.counters.backward_asked_again == 0 and caller.client.calls == [("b1", "backward", False)]
