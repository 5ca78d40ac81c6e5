"""How the trainer records a chained call that failed (swarm/trainer/chain_call.py): each hop the
chain failed over from is counted by its kind, as a failed call of that replica, and routed around
for a while; what the answer reports outside the route is not counted. Without a network: the
caller's counters, ledger and ban list are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.trainer.chain_call import ChainCaller
from swarm.trainer.client import ChainCallError
from swarm.trainer.contributions import ContributionLedger
from swarm.trainer.failures import BanList
from swarm.trainer.stage_call import CallCounters
from wire.failures import Failure
from wire.protocol import HopFailover

ROUTE = [["a0"], ["b0", "b1"], ["c0", "c1"]]


def chain_caller() -> tuple[ChainCaller, list[dict]]:
    observed: list[dict] = []
    view = SimpleNamespace(bans=BanList(), violations=None)
    caller = SimpleNamespace(
        view=view,
        client=None,
        counters=CallCounters(),
        contributions=ContributionLedger(),
        metrics=SimpleNamespace(observe_failure=lambda **labels: observed.append(labels)),
        not_allowed_by={},
    )
    return ChainCaller(caller), observed


def failed_calls(chain: ChainCaller) -> dict[str, tuple[int, int]]:
    return {p: (c["stage"], c["calls_failed"]) for p, c in chain.caller.contributions.snapshot().items()}


def test_a_chain_that_failed_at_a_later_stage_counts_every_hop_it_failed_over_from():
    chain, observed = chain_caller()
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
    failures: list[str] = []
    chain._note_failure(error, ROUTE, failures, took_s=0.5)

    counters = chain.caller.counters
    assert counters.calls_retried == 1 and len(failures) == 1  # one microbatch driven again
    assert counters.failures_by_kind == {"garbage": 1, "timeout": 1, "transport": 1}
    assert sorted((o["stage"], o["kind"]) for o in observed) == [(1, "garbage"), (2, "timeout"), (2, "transport")]
    assert failed_calls(chain) == {"b0": (1, 1), "c0": (2, 1), "c1": (2, 1)}  # each once, not twice
    assert chain.view.bans.banned() == {"b0", "c0", "c1"}


def test_a_chain_that_failed_on_its_first_call_counts_that_call():
    chain, observed = chain_caller()
    error = ChainCallError("a0", Failure.TRANSPORT, "the stream broke", stage=0, failed_peers=["a0"])
    chain._note_failure(error, ROUTE, [], took_s=0.5)

    assert chain.caller.counters.failures_by_kind == {"transport": 1}
    assert observed == [{"stage": 0, "rpc": "train_chain", "kind": "transport"}]
    assert failed_calls(chain) == {"a0": (0, 1)} and chain.view.bans.banned() == {"a0"}
