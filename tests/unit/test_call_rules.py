"""The one rule set every caller of a replica follows (wire/call_rules.py): the trainer's hub calls,
its chains and a peer's hops ask the same replica again by the same rule, blame by the same
penalties and count the same budget."""

import pytest

from wire.call_rules import Attempts, Penalty, asks_again, penalty_for
from wire.failures import Failure

HUB_BACKWARD = dict(adds_work=True, waits_on_others=False)  # also a hop to the last stage
HUB_FORWARD = dict(adds_work=False, waits_on_others=False)
CHAIN = dict(adds_work=True, waits_on_others=True)  # the trainer's chain, a hop before the last stage


@pytest.mark.parametrize(
    ("work", "kind", "expected"),
    [
        (HUB_BACKWARD, Failure.TIMEOUT, True),  # computed, its answer maybe lost: the same replica first
        (HUB_BACKWARD, Failure.TRANSPORT, True),
        (HUB_BACKWARD, Failure.INTERNAL, False),  # an answer: the peer failed it and did not count it
        (HUB_BACKWARD, Failure.GARBAGE, False),
        (HUB_BACKWARD, Failure.WRONG_STAGE, False),
        (HUB_FORWARD, Failure.TIMEOUT, False),  # a forward adds nothing: any replica will do
        (HUB_FORWARD, Failure.TRANSPORT, False),
        (CHAIN, Failure.TRANSPORT, True),  # the stream broke
        (CHAIN, Failure.TIMEOUT, False),  # the hang may be further down the chain
        (CHAIN, Failure.INTERNAL, False),
    ],
)
def test_who_is_asked_again(work, kind, expected):
    assert asks_again(kind, **work) is expected
    attempts = Attempts(max_failures=3, **work)
    attempts.failed("peer-a", kind, "failed")
    assert attempts.take_again() == ("peer-a" if expected else None)
    assert attempts.take_again() is None  # taken once


@pytest.mark.parametrize("work", [HUB_BACKWARD, CHAIN])
def test_a_replica_is_asked_again_once_each(work):
    attempts = Attempts(max_failures=5, **work)
    attempts.failed("peer-a", Failure.TRANSPORT, "lost")
    assert attempts.take_again() == "peer-a"
    attempts.failed("peer-a", Failure.TRANSPORT, "lost again")
    assert attempts.take_again() is None  # twice: most likely gone, go elsewhere
    attempts.failed("peer-b", Failure.TRANSPORT, "lost")
    assert attempts.take_again() == "peer-b"  # once per replica
    assert attempts.failed_peers() == {"peer-a", "peer-b"}


def test_a_call_the_caller_cut_is_not_asked_again():
    attempts = Attempts(max_failures=5, **HUB_BACKWARD)
    attempts.failed("newcomer", Failure.TIMEOUT, "no answer within its probation", cut=True)
    assert attempts.take_again() is None and attempts.failed_peers() == {"newcomer"}
    attempts.failed("peer-a", Failure.TIMEOUT, "no answer in time")
    assert attempts.take_again() == "peer-a"  # a timeout the caller did not cut: asked again, as before


def test_the_budget_is_spent_after_max_failures_retries_and_then_nobody_is_asked_again():
    attempts = Attempts(max_failures=1, **HUB_BACKWARD)
    attempts.failed("peer-a", Failure.INTERNAL, "failed")
    assert not attempts.spent and attempts.attempts_left == 1
    attempts.failed("peer-b", Failure.TIMEOUT, "lost")
    assert attempts.spent and attempts.attempts_left == 0 and attempts.take_again() is None
    assert [(f.peer_id, f.kind) for f in attempts.failures] == [
        ("peer-a", Failure.INTERNAL),
        ("peer-b", Failure.TIMEOUT),
    ]
    attempts.reset()  # after a wait for the swarm: a fresh budget, nobody excluded
    assert not attempts.spent and attempts.failed_peers() == set() and attempts.failures == ()


def test_without_a_budget_only_the_candidates_bound_the_attempts():
    attempts = Attempts(**CHAIN)
    for n in range(50):
        attempts.failed(f"peer-{n}", Failure.INTERNAL, "failed")
    assert not attempts.spent and attempts.attempts_left is None


def test_a_chains_failure_excludes_the_replicas_it_names_not_only_the_one_called():
    attempts = Attempts(max_failures=3, **CHAIN)
    attempts.failed("a0", Failure.INTERNAL, "stage 2 failed", excluded=["c0", "c1"])
    assert attempts.failed_peers() == {"c0", "c1"}


def test_negative_budgets_are_refused():
    with pytest.raises(ValueError):
        Attempts(max_failures=-1)


@pytest.mark.parametrize(
    ("kind", "message", "witnessed", "penalty"),
    [
        (Failure.TIMEOUT, "", True, Penalty.BAN),
        (Failure.TRANSPORT, "", False, Penalty.BAN),
        (Failure.INTERNAL, "", True, Penalty.BAN),
        (Failure.REFUSED, "a bad request", True, Penalty.BAN),  # our bug; probing again costs little
        (Failure.REFUSED, "not authorized: no credential", True, Penalty.SHUT_OUT),
        (Failure.REFUSED, "not on its --allowed-peers", False, Penalty.SHUT_OUT),
        (Failure.WRONG_STAGE, "", True, Penalty.STAGE_BAN),
        (Failure.WRONG_STAGE, "", False, Penalty.STAGE_BAN),
        (Failure.GARBAGE, "", True, Penalty.IDENTITY_BAN),  # its own answer broke the contract
        (Failure.GARBAGE, "", False, Penalty.BAN),  # a peer's word about another: no proof
        (Failure.CACHE_MISS, "", True, Penalty.NONE),
    ],
)
def test_penalties(kind, message, witnessed, penalty):
    assert penalty_for(kind, message, witnessed=witnessed) == penalty
