"""The peer's rebalancing loop checks as soon as a stage loses a replica, not only at its period.

Drives `StageMoves.rebalance_forever` with a scripted swarm (no DHT, no network): the decisions
are the real peers/placement/rebalance.py functions.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from dht.records import PeerState
from peers.config import PlacementSettings
from peers.placement.rebalance import SETTLE_SHARE, ReplicaView, SettleWatch, peers_settling, settle_share
from peers.placement.stage_moves import StageMoves


def online(peer_id: str, stage: int) -> ReplicaView:
    return ReplicaView(peer_id, stage, 1.0, "online")


class ScriptedPeer(StageMoves):
    """Stage 0: us (a-me) + p1 + p2; stage 1: q1 + q2, until q2 leaves after our first look."""

    def __init__(self, *, loss_watch_s: float) -> None:
        serving = SimpleNamespace(
            state=PeerState.ONLINE,
            requests_served=100,
            runtime=SimpleNamespace(stage=0, num_stages=2, throughput=SimpleNamespace(value=1.0)),
        )
        settings = PlacementSettings(
            rebalance_period_s=1000.0,
            rebalance_loss_watch_s=loss_watch_s,
            rebalance_loss_delay_s=0.05,
            rebalance_min_gain=0.2,
        )
        super().__init__(
            serving, None, None, settings, peer_id="a-me", model="tiny", builder=None, announcer=None, replicas=None
        )
        self.others = [online("p1", 0), online("p2", 0), online("q1", 1), online("q2", 1)]
        self.looks = 0
        self.moved_to: list[int] = []

    async def swarm_views(self, *, include_self: bool = True) -> list[ReplicaView]:
        self.looks += 1
        if self.looks == 2:  # q2 leaves (its record expires) between our first and second look
            self.others = [r for r in self.others if r.peer_id != "q2"]
        return self.others + ([online(self.peer_id, self.serving.runtime.stage)] if include_self else [])

    async def move_to_stage(self, stage: int, p2p, seen_replicas=()) -> None:
        self.moved_to.append(stage)
        self.stop.set()

    async def _claim_move(self, decision, stop) -> str:  # no DHT here: every claim wins
        return "scripted"


async def run_for(peer: ScriptedPeer, seconds: float) -> float:
    peer.stop = asyncio.Event()
    started = time.monotonic()
    try:
        await asyncio.wait_for(peer.rebalance_forever(None, peer.stop), timeout=seconds)
    except TimeoutError:
        pass
    return time.monotonic() - started


def test_a_lost_replica_triggers_a_check_long_before_the_period():
    # 3 vs 1 after q2 left: the plan moves the lowest peer_id of stage 0 (us) to stage 1 (2 vs 2).
    peer = ScriptedPeer(loss_watch_s=0.02)
    elapsed_s = asyncio.run(run_for(peer, 5.0))
    assert peer.moved_to == [1] and elapsed_s < 2.0  # the periodic check is 500-1500 s away


def test_without_the_watch_the_peer_waits_for_its_period():
    peer = ScriptedPeer(loss_watch_s=0.0)
    asyncio.run(run_for(peer, 0.5))
    assert peer.moved_to == [] and peer.looks == 0


class MovedPeer(ScriptedPeer):
    """2:2 at our first look; from the second on, q2 serves stage 0 (it moved) and q1's announced
    throughput dips, so that the plan would send us to stage 1 at once."""

    async def swarm_views(self, *, include_self: bool = True) -> list[ReplicaView]:
        self.looks += 1
        others = [online("p1", 0), online("q1", 1), online("q2", 1)]
        if self.looks >= 2:
            others = [online("p1", 0), ReplicaView("q1", 1, 0.5, "online"), online("q2", 0)]
        self.decided_at = time.monotonic()
        return others + ([online(self.peer_id, self.serving.runtime.stage)] if include_self else [])


def test_after_another_peer_moves_the_peer_waits_for_the_swarm_to_settle(capsys):
    peer = MovedPeer(loss_watch_s=0.0)
    peer.settings = PlacementSettings(rebalance_period_s=0.2, rebalance_loss_watch_s=0.0, rebalance_min_gain=0.2)
    started = time.monotonic()
    asyncio.run(run_for(peer, 5.0))
    out = capsys.readouterr().out
    assert peer.moved_to == [1], out
    assert "because the swarm is settling after a move (q2" in out, out
    # the move was seen at the second look; the peer moved 2 periods (0.4 s) after it, not before
    assert peer.looks >= 3 and peer.decided_at - started >= 0.2 + 0.4, out


def test_peers_settling_names_peers_serving_another_stage_with_a_material_share_of_it():
    before = [online("a", 0), online("b", 0), online("c", 1), ReplicaView("d", 1, 1.0, "offline"), online("f", 1)]
    after = [
        online("a", 0),
        ReplicaView("b", 1, 1.0, "joining"),  # moved, still joining: a third of stage 1
        online("c", 1),
        online("d", 0),  # was not serving: an arrival, not a move
        ReplicaView("e", 0, 1.0, "joining"),  # a newcomer
        online("f", 1),
    ]
    assert peers_settling(before, after, 2, share=0.2) == ("b",)
    assert peers_settling(before, after, 2, share=0.4) == ()  # 1 of stage 1's 3 samples/s
    assert peers_settling(None, after, 2, share=0.2) == ()
    assert peers_settling(after, after, 2, share=0.2) == ()


def test_settle_watch_holds_for_settle_s_after_a_move_it_saw_or_made():
    watch = SettleWatch(settle_s=10.0, share=0.2)
    before = [online("a", 0), online("b", 0), online("c", 1)]
    watch.look(before, 2, now=0.0)  # the first look: nothing to compare with
    assert watch.settling_since(0.0) is None
    watch.look([online("a", 0), online("b", 1), online("c", 1)], 2, now=5.0)
    assert watch.movers == ("b",)
    assert watch.settling_since(12.0) == 7.0
    assert watch.settling_since(15.0) is None  # settled
    watch.look([online("a", 0), online("b", 1), online("c", 1)], 2, now=20.0)  # no move since
    assert watch.settling_since(20.0) is None
    watch.moved("me", now=21.0)
    assert watch.movers == ("me",) and watch.settling_since(30.0) == 9.0


def test_a_move_that_undoes_a_move_made_or_seen_is_barred_for_return_s():
    watch = SettleWatch(settle_s=10.0, share=0.2, return_s=30.0)
    assert watch.return_barred_s(1, 0, now=0.0) is None  # no move yet
    watch.moved("me", now=100.0, from_stage=0, to_stage=1)
    assert watch.return_barred_s(1, 0, now=120.0) == 20.0  # back where it came from: barred
    assert watch.return_barred_s(1, 2, now=120.0) is None  # elsewhere: only the settle rule
    assert watch.return_barred_s(0, 1, now=120.0) is None  # the same way again: not a return
    assert watch.return_barred_s(1, 0, now=130.0) is None  # a return real throughputs call for, later
    # Another peer's material move, seen between two looks, bars its reverse for this peer too
    watch.look([online("a", 0), online("b", 0), online("c", 1), online("d", 2)], 3, now=200.0)
    watch.look([online("a", 0), online("b", 2), online("c", 1), online("d", 2)], 3, now=205.0)
    assert watch.movers == ("b",)
    assert watch.return_barred_s(2, 0, now=210.0) == 5.0 and watch.return_barred_s(0, 2, now=210.0) is None
    assert SettleWatch(settle_s=10.0, share=0.2).return_barred_s(1, 0, now=0.0) is None  # return_s 0: off


def test_a_move_makes_others_settle_from_a_tenth_of_its_stage_or_the_min_gain_if_larger():
    assert settle_share(0.01) == SETTLE_SHARE == 0.1  # a 1% mover in a large swarm holds nobody back
    assert settle_share(0.2) == 0.2  # the peer's default --rebalance-min-gain
