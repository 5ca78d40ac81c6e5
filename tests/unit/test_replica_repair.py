"""Which sync replicas catch up after a commit (swarm/trainer/schedule.py: replicas_to_repair), and
how the members of a sync round decide to step (peers/replicas/averaging.py)."""

from peers.replicas.averaging import round_has_samples
from swarm.trainer.schedule import CatchUp, OuterCatchUp, outer_replicas_to_repair, replicas_to_repair
from wire.protocol import CommitResponse


def answer(steps: int, *, stepped: bool = False, averaged: bool = False, group: int = 0) -> CommitResponse:
    return CommitResponse(steps_done=steps, stepped=stepped, averaged=averaged, group_size=group)


def test_replicas_at_equal_step_counts_need_no_repair_whatever_they_answered():
    # e.g. one replica's round found no partner (a second trainer's commit took its partner first)
    assert replicas_to_repair({"a": answer(5, stepped=True, averaged=True), "b": answer(5)}) == []
    assert replicas_to_repair({"a": answer(5)}) == []


def test_a_round_failed_on_one_side_drops_the_gradients_the_partners_update_holds():
    answers = {
        "a": answer(6, stepped=True, averaged=True, group=3),
        "b": answer(5),
        "c": answer(6, stepped=True, averaged=True, group=3),
    }
    assert replicas_to_repair(answers) == [CatchUp("b", "a", 6, drops_gradients=True)]


def test_a_replica_outside_a_smaller_round_keeps_its_gradients():
    # "b" joined a step behind: "a" and "c" formed a group of two without it
    answers = {
        "a": answer(6, stepped=True, averaged=True, group=2),
        "b": answer(5),
        "c": answer(6, stepped=True, averaged=True, group=2),
    }
    assert replicas_to_repair(answers) == [CatchUp("b", "a", 6, drops_gradients=False)]


def test_a_replica_left_behind_earlier_keeps_its_own_gradients():
    # neither stepped on this commit (their rounds could not meet: different step counts)
    assert replicas_to_repair({"a": answer(7), "b": answer(6)}) == [CatchUp("b", "a", 7, drops_gradients=False)]


def test_a_replica_that_stepped_but_answered_earlier_than_its_partner_keeps_its_gradients():
    # two trainers: "a" answered this commit after one round, "b" after two
    repairs = replicas_to_repair(
        {"a": answer(3, stepped=True, averaged=True), "b": answer(4, stepped=True, averaged=True)}
    )
    assert repairs == [CatchUp("a", "b", 4, drops_gradients=False)]


def test_every_member_decides_to_step_from_the_declared_weights_alone():
    assert round_has_samples({"a": 4.0, "b": 1e-6})
    assert not round_has_samples({"a": 1e-6, "b": 1e-6})


def test_a_step_count_that_jumped_since_the_last_commit_is_not_believed():
    """Issue #60: a replica answering 10^6 steps was every other replica's repair source."""
    from swarm.trainer.schedule import plausible_steps

    answers = {"honest": answer(21, stepped=True, averaged=True), "forger": answer(10**6)}
    assert set(plausible_steps(answers, {"honest": 20, "forger": 20})) == {"honest"}
    assert set(plausible_steps(answers, {})) == {"honest", "forger"}  # never seen: any count (a new trainer)
    believed = plausible_steps({"a": answer(24), "b": answer(20)}, {"a": 20, "b": 20})
    assert replicas_to_repair(believed) == [CatchUp("b", "a", 24, drops_gradients=False)]  # 4 in a step: retries


def outer(rounds: int, anchor: str) -> CommitResponse:
    return CommitResponse(steps_done=10, stepped=True, outer_rounds=rounds, anchor=anchor)


def test_outer_replicas_whose_anchor_differs_load_the_state_of_the_one_with_most_rounds():
    """A round applied on one side only: the replica without it loads the state of the one with it."""
    assert outer_replicas_to_repair({"a": outer(3, "x"), "b": outer(3, "x")}) == []
    assert outer_replicas_to_repair({"a": outer(3, "x"), "b": outer(2, "y")}) == [OuterCatchUp("b", "a", 3)]
    # equal counts, anchors apart (e.g. a joiner that loaded its state while a round was in flight):
    # the anchor most of them hold wins, then the first peer id
    three = {"a": outer(4, "y"), "b": outer(4, "x"), "c": outer(4, "x")}
    assert outer_replicas_to_repair(three) == [OuterCatchUp("a", "b", 4)]
    assert outer_replicas_to_repair({"a": outer(4, "y"), "b": outer(4, "x")}) == [OuterCatchUp("b", "a", 4)]
