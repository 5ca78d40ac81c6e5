"""From DHT records to rebalancer views, `--stage auto`, `--standby` and the new peer flags."""

import pytest

from dht.records import PeerRecord, PeerState
from peers.config import AUTO_STAGE, PeerConfig
from peers.placement.rebalance import ReplicaView, decide_move, plan_rebalance
from peers.placement.stage_choice import choose_stage, choose_standby_stage, replica_views
from process.config import ConfigError, from_sources


def record(
    peer_id: str,
    stage: int,
    state: str = "online",
    throughput: float = 1.0,
    *,
    expires_at: float = 100.0,
    num_stages: int = 2,
) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        model="tiny",
        stage=stage,
        num_stages=num_stages,
        state=PeerState(state),
        throughput=throughput,
        expires_at=expires_at,
    )


def test_a_moved_peer_counts_once_at_its_new_stage():
    records = [
        record("a", 0, "offline", expires_at=200.0),
        record("a", 1, "joining", expires_at=150.0),
        record("b", 0),
        record("c", 0),
    ]
    views = replica_views(records, 2)
    assert [(v.peer_id, v.stage, v.state) for v in views] == [
        ("a", 1, "joining"),
        ("b", 0, "online"),
        ("c", 0, "online"),
    ]


def test_of_two_serving_records_the_later_one_wins_and_my_own_view_beats_the_dht():
    records = [record("a", 0, expires_at=100.0), record("a", 1, expires_at=120.0), record("b", 0)]
    assert [(v.peer_id, v.stage) for v in replica_views(records, 2)] == [("a", 1), ("b", 0)]
    me = ReplicaView("b", 1, 7.0, "online")
    assert replica_views(records, 2, me=me)[1] == me


def test_my_own_throughput_is_the_one_i_announced_so_every_peer_plans_with_the_same_snapshot():
    """Two stage-0 peers of a 3:1 swarm whose live throughputs each fall below the other's announced
    one: planning with its own live value, each would find itself the slower one and both would move."""
    records = [record("a", 0, throughput=10.0), record("b", 0, throughput=10.5), record("c", 0), record("d", 1)]
    mine = [ReplicaView("a", 0, 10.4, "online"), ReplicaView("b", 0, 9.9, "online")]
    live = [[v for v in replica_views(records, 2) if v.peer_id != me.peer_id] + [me] for me in mine]
    assert [[m.peer_id for m in plan_rebalance(v, 2).moves] for v in live] == [["a"], ["b"]]  # the herd
    plans = []
    for me in mine:
        views = replica_views(records, 2, me=me)
        assert next(v for v in views if v.peer_id == me.peer_id).throughput == (10.0 if me.peer_id == "a" else 10.5)
        plans.append([(m.peer_id, m.to_stage) for m in plan_rebalance(views, 2).moves])
    assert plans == [[("a", 1)], [("a", 1)]]
    joining = ReplicaView("a", 1, 10.4, "joining")  # a move: a record at another stage does not apply
    assert replica_views(records, 2, me=joining)[0] == joining


def test_standby_and_other_splits_are_not_serving_replicas():
    records = [record("s", 1, "standby"), record("x", 0, num_stages=3), record("a", 0)]
    assert [v.peer_id for v in replica_views(records, 2)] == ["a"]


def test_views_feed_decide_move_without_duplicates():
    """The 3:1 start of the integration test: exactly one stage-0 peer is told to move."""
    records = [record("a", 0), record("b", 0), record("c", 0), record("d", 1)]
    views = replica_views(records, 2)
    decisions = {p: decide_move(p, views, 2, min_gain=0.2) for p in "abcd"}
    movers = [p for p, d in decisions.items() if d.move]
    assert len(movers) == 1 and decisions[movers[0]].to_stage == 1
    # Once the mover is seen joining stage 1, nobody else moves.
    after = replica_views(
        records
        + [record(movers[0], 0, "offline", expires_at=300.0), record(movers[0], 1, "joining", expires_at=301.0)],
        2,
    )
    assert not any(decide_move(p, after, 2, min_gain=0.2).move for p in "abcd")


def test_auto_stage_joins_the_thinnest_stage_unless_a_plan_names_one():
    records = [record("a", 0), record("b", 0), record("c", 1, throughput=1.5)]
    assert choose_stage(records, 2, 1.0) == 1
    assert choose_stage([], 2, 1.0) == 0
    assert choose_stage(records, 2, 1.0, planned_stage=0) == 0  # issue #8: the plan wins
    with pytest.raises(ValueError, match="outside"):
        choose_stage(records, 2, 1.0, planned_stage=2)


def test_standby_holds_the_thinnest_stage():
    assert choose_standby_stage([record("a", 0), record("b", 0), record("c", 1)], 2) == 1
    assert choose_standby_stage([record("a", 0)], 2) == 1  # an empty stage is the thinnest


def peer_config(**options) -> PeerConfig:
    """A PeerConfig as the flags named by `options` (leaf names, whatever their section) make it."""
    return from_sources(PeerConfig, env={}, **options)


def test_peer_config_stage_auto_standby_and_rebalancing_flags():
    assert peer_config(model="tiny", stage="1", num_stages=2).stage == 1
    assert peer_config(model="tiny", stage="auto", num_stages=2).stage == AUTO_STAGE
    assert peer_config(model="tiny", standby=True, num_stages=2).stage == AUTO_STAGE
    with pytest.raises(ConfigError, match="standby chooses"):
        peer_config(model="tiny", stage=1, standby=True)
    with pytest.raises(ConfigError, match="stage number or auto"):
        peer_config(model="tiny", stage="first")
    with pytest.raises(ConfigError, match="rebalance"):
        peer_config(model="tiny", stage=0, rebalance_period_s=-1.0)
    assert peer_config(model="tiny", stage=0).placement.rebalance_period_s == 0.0  # off unless asked for
