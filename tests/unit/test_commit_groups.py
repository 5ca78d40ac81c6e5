"""Who each sync replica averages with at a commit (swarm/trainer/schedule.py: commit_groups)."""

from swarm.trainer.schedule import commit_groups


def test_without_an_authority_every_replica_averages_with_all():
    assert commit_groups(["a", "b", "c"], None) == [["a", "b", "c"]]


def test_a_replica_without_a_credential_is_not_counted_in_the_members_group_and_averages_alone():
    # an open run: "x" serves but holds no peer credential; the members refuse it in their rounds
    assert commit_groups(["a", "x", "b"], frozenset({"a", "b"})) == [["a", "b"], ["x"]]


def test_no_members_online_every_replica_steps_alone():
    assert commit_groups(["x", "y"], frozenset()) == [[], ["x"], ["y"]]
