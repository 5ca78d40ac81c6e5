"""ProtocolViolations and NewcomerCap: a peer that breaks the protocol is avoided for long, and
peers first seen lately take a bounded share of a stage's calls (issue #30)."""

import pytest

from swarm.trainer.failures import ProtocolViolations
from swarm.trainer.newcomers import NewcomerCap
from swarm.trainer.routing import ReplicaInfo, ReplicaScheduler


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_wrong_stage_answer_bans_the_peer_on_that_stage_only_and_for_long():
    clock = FakeClock()
    violations = ProtocolViolations(stage_ban_s=900.0, clock=clock)
    assert violations.wrong_stage("fake", 1, "serves stage 0") == 900.0
    assert violations.banned(1) == {"fake"}
    assert violations.banned(0) == set()  # an honest peer that moved serves its new stage
    clock.now_s += 899.0
    assert violations.banned(1) == {"fake"}  # far longer than a failure's backoff ban
    clock.now_s += 1.0
    assert violations.banned(1) == set()
    assert violations.reasons == {}


def test_a_malformed_answer_bans_the_identity_everywhere():
    clock = FakeClock()
    violations = ProtocolViolations(identity_ban_s=3600.0, clock=clock)
    violations.malformed("nan", "outputs contain NaN")
    assert all(violations.banned(stage) == {"nan"} for stage in range(4))
    assert violations.reasons == {"nan": "outputs contain NaN"}
    clock.now_s += 3600.0
    assert violations.banned(0) == set()


def test_violation_memory_is_bounded_oldest_first():
    violations = ProtocolViolations(max_peers=3, clock=FakeClock())
    for peer in "abcd":
        violations.wrong_stage(peer, 0, "x")
    assert violations.banned(0) == {"b", "c", "d"}
    with pytest.raises(ValueError):
        ProtocolViolations(stage_ban_s=0.0)


def test_nine_fake_records_that_answer_wrong_stage_take_one_call_each():
    """Routing with bans: fakes announcing a huge throughput are tried once, then never again."""
    clock = FakeClock()
    scheduler = ReplicaScheduler(clock=clock)
    fakes = [f"fake{i}" for i in range(9)]
    scheduler.update_replicas([ReplicaInfo("honest", 10.0)] + [ReplicaInfo(f, 1e6) for f in fakes])
    violations = ProtocolViolations(clock=clock)
    attempts = {peer: 0 for peer in ["honest", *fakes]}
    for _ in range(200):
        while True:
            peer = scheduler.choose("forward", 4, exclude=violations.banned(1))
            attempts[peer] += 1
            if peer == "honest":
                scheduler.report_success(peer, "forward", 4, 0.4)
                break
            scheduler.report_failure(peer)
            violations.wrong_stage(peer, 1, "serves another stage")
    assert all(attempts[f] == 1 for f in fakes), attempts
    assert attempts["honest"] == 200


def test_peers_of_the_first_sighting_are_not_newcomers_and_a_lone_newcomer_is_used():
    clock = FakeClock()
    cap = NewcomerCap(window_s=300.0, max_share=0.25, clock=clock)
    cap.saw([])  # a stage with no replica yet: its first replicas are not held back
    cap.saw(["a", "b"])
    assert not cap.is_newcomer("a") and not cap.is_newcomer("b")
    cap.saw(["a", "b", "new"])
    assert cap.is_newcomer("new")
    assert cap.excluded({"new"}) == set()  # the only candidate: used
    clock.now_s += 300.0
    assert not cap.is_newcomer("new")


def test_newcomers_together_take_at_most_their_share_of_a_stage():
    clock = FakeClock()
    cap = NewcomerCap(window_s=300.0, max_share=0.25, recent_calls=100, clock=clock)
    cap.saw(["old"])
    flood = [f"new{i}" for i in range(20)]
    cap.saw(["old", *flood])
    scheduler = ReplicaScheduler(clock=clock)
    scheduler.update_replicas([ReplicaInfo("old", 1.0)] + [ReplicaInfo(p, 1e6) for p in flood])
    calls = {"old": 0, "new": 0}
    for _ in range(400):
        peer = scheduler.choose("forward", 1, exclude=cap.excluded(set(scheduler.keys_s())))
        cap.called(peer)
        calls["old" if peer == "old" else "new"] += 1
    # Without the cap the flood, announcing a million samples/s, would take nearly every call.
    assert calls["new"] / 400 <= 0.25 + 0.01, calls
    assert cap.share() <= 0.25 + 0.01
    clock.now_s += 301.0  # past the window they are peers like the others
    assert cap.excluded(set(scheduler.keys_s())) == set()
