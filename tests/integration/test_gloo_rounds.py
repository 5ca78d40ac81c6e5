"""Exact sync's all-reduce over gloo (peers/replicas/gloo_allreduce.py), between real gloo process
groups on loopback (threads of this process stand for the replicas): the weighted mean of the
members' gradients, robustly in groups of three, and a round that fails when a member is missing."""

from __future__ import annotations

import threading

import pytest
import torch

from peers.replicas.gloo_allreduce import GlooRounds, announced_host

pytestmark = pytest.mark.slow


def run_round(rounds, flats, weights, *, step_id="run:1", robust="none", tensor_sizes=None, members=None):
    """Every member's `average` at once; their results (True/False)."""
    members = members or sorted(weights)
    leader = rounds[members.index(min(members))].address
    results = [None] * len(members)

    def member(i):
        results[i] = rounds[i].average(
            flats[i], leader=leader, step_id=step_id, me=members[i], weights=weights, robust=robust,
            tensor_sizes=tensor_sizes,
        )  # fmt: skip

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_a_round_is_the_mean_weighted_by_the_trainers_counts():
    rounds = [GlooRounds("127.0.0.1", timeout_s=20) for _ in range(2)]
    torch.manual_seed(0)
    grads = [torch.randn(100_000), torch.randn(100_000)]
    flats = [g.clone() for g in grads]
    weights = {"peerA": 3.0, "peerB": 1.0}
    assert run_round(rounds, flats, weights) == [True, True]
    expected = (3 * grads[0] + grads[1]) / 4
    for flat in flats:
        torch.testing.assert_close(flat, expected, atol=1e-6, rtol=0)
    assert torch.equal(flats[0], flats[1])  # every member holds the same values
    # the next commit's round, a group of its own under another prefix, on the same rendezvous
    flats = [g.clone() for g in grads]
    assert run_round(rounds, flats, weights, step_id="run:2") == [True, True]


def test_a_group_of_three_reduces_robustly_and_bounds_a_liar():
    rounds = [GlooRounds("127.0.0.1", timeout_s=20) for _ in range(3)]
    torch.manual_seed(1)
    honest = [torch.randn(4096) * 0.01 + 1.0 for _ in range(2)]
    liar = -1000.0 * honest[0]
    flats = [honest[0].clone(), honest[1].clone(), liar.clone()]
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    assert run_round(rounds, flats, weights, robust="clip", tensor_sizes=[4096]) == [True] * 3
    honest_mean = (honest[0] + honest[1]) / 2
    assert float((flats[0] - honest_mean).norm()) < 0.01 * float((liar / 3).norm())
    assert torch.equal(flats[0], flats[1])


def test_a_round_whose_member_never_comes_fails_at_its_timeout():
    rounds = [GlooRounds("127.0.0.1", timeout_s=2)]
    flat = torch.randn(1000)
    leader = rounds[0].address
    assert not rounds[0].average(flat, leader=leader, step_id="run:1", me="a", weights={"a": 1.0, "b": 1.0})


def test_the_rendezvous_listens_on_an_address_the_peer_announces():
    assert announced_host([], ["/ip4/127.0.0.1/tcp/0"]) == "127.0.0.1"
    assert announced_host(["/ip4/10.0.0.5/tcp/4000"], ["/ip4/0.0.0.0/tcp/0"]) == "10.0.0.5"
    assert announced_host([], ["/ip4/0.0.0.0/tcp/31337"]) is None
