"""Claims before moves: the record a peer states before a rebalancing move, and the pure rule by
which peers whose snapshots each named themselves the mover agree on who moves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.records import MoveClaim, PeerState, parse_move_claims
from peers.config import PlacementSettings
from peers.placement import stage_moves
from peers.placement.rebalance import ClaimView, ReplicaView, claim_verdict, decide_move
from peers.placement.stage_choice import claim_view

NOW = 100.0


def claim(
    peer: str, from_stage: int = 0, to_stage: int = 1, *, since: float = 0.0, moves_from: int = 1, moves_to: int = 1
) -> ClaimView:
    return ClaimView(peer, from_stage, to_stage, moves_from, moves_to, since, expires_at=NOW + 10)


def winners(claims: list[ClaimView]) -> list[str]:
    """Who moves when every claimant reads all of `claims` back."""
    return sorted(c.peer_id for c in claims if claim_verdict(c, claims, NOW).wins)


def record(peer: str = "a", **fields) -> MoveClaim:
    values = dict(
        peer_id=peer, model="tiny", num_stages=2, from_stage=0, to_stage=1, moves_from=1, moves_to=1, since=1.0
    )
    return MoveClaim(**{**values, "expires_at": 10.0, **fields})


def test_a_claim_names_two_different_stages_of_the_split():
    with pytest.raises(ValueError, match="to itself"):
        record(to_stage=0)
    with pytest.raises(ValueError, match="not both of 2 stages"):
        record(to_stage=2)
    with pytest.raises(ValueError):
        record(moves_from=0)  # a claimed move is in its plan: at least one move out of its stage


def test_parsing_skips_malformed_and_misfiled_claims():
    entries = {
        "a": record("a").to_wire(),
        "b": {**record("b").to_wire(), "moves_from": "one"},  # wrong type
        "c": record("someone-else").to_wire(),  # subkey does not match
        "d": "not a mapping",
        "e": record("e", model="other").to_wire(),  # another model
        "f": {**record("f").to_wire(), "future_field": 1},  # newer peers may add fields
        "g": {**record("g").to_wire(), "to_stage": 0},  # a move to its own stage
    }
    parsed = parse_move_claims(entries, model="tiny")
    assert [c.peer_id for c in parsed] == ["a", "f"]
    assert claim_view(parsed[0]) == ClaimView("a", 0, 1, 1, 1, 1.0, 10.0, True)


def test_the_dht_keeps_only_signed_small_claims_of_the_signers_own_peer_id():
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    from dht.keys import moves_key
    from dht.record_policy import _key_id, protected_keys
    from tests.unit.test_record_policy import NOW as POLICY_NOW
    from tests.unit.test_record_policy import signed_subkey, validator

    def stored(subkey, value: bytes = b"\x80"):
        return DHTRecord(_key_id(moves_key("tiny")), MSGPackSerializer.dumps(subkey), value, POLICY_NOW + 10)

    assert protected_keys(["tiny"])[_key_id(moves_key("tiny"))].kind == "moves"
    assert validator().refusal(stored(signed_subkey(0))) is None
    assert validator().refusal(stored(b"12D3KooWjunk")) == "unsigned"
    assert validator().refusal(stored(signed_subkey(0), value=b"x" * (8 << 10))) == "value too large"


def test_of_two_peers_that_each_planned_the_one_move_the_earlier_claim_moves():
    """The herd of two seen in tests/integration/test_rebalance.py: two stage-0 peers each found
    itself the one mover in its own snapshot. Whoever reads the claims, only the earlier moves."""
    first, second = claim("b", since=1.0), claim("a", since=2.5)
    assert winners([first, second]) == ["b"]
    assert "claimed 1 move(s) out of stage 0 first, and the plans allow 1" in claim_verdict(second, [first], NOW).reason
    assert claim_verdict(first, [first, second], NOW).wins  # a later claim never unseats an earlier one
    assert claim_verdict(first, [], NOW).wins  # alone (its own claim not read back yet)


def test_claims_at_the_same_moment_go_by_peer_id():
    assert winners([claim("b", since=1.0), claim("a", since=1.0)]) == ["a"]


def test_a_plan_of_two_moves_out_of_a_stage_lets_its_first_two_claimants_go():
    claims = [claim(p, since=t, moves_from=2, moves_to=2) for p, t in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    assert winners(claims) == ["a", "b"]


def test_the_fewest_moves_any_plan_ahead_allows_bounds_the_movers():
    """Snapshots may disagree on how many must move: the movers are never more than any of the
    earlier claimants' plans (or one's own) allows."""

    def two(first_plan: int, second_plan: int) -> list[ClaimView]:
        return [
            claim("a", since=1.0, moves_from=first_plan, moves_to=first_plan),
            claim("b", since=2.0, moves_from=second_plan, moves_to=second_plan),
        ]

    assert winners(two(1, 2)) == ["a"]
    assert winners(two(2, 1)) == ["a"]
    assert winners(two(2, 2)) == ["a", "b"]


def test_claims_into_one_stage_from_two_stages_count_against_the_target():
    """Two snapshots that each fill stage 2 once, from different stages, fill it once."""
    one = [claim("a", 0, 2, since=1.0), claim("b", 1, 2, since=2.0)]
    assert winners(one) == ["a"]
    assert "move(s) into stage 2 first" in claim_verdict(one[1], one, NOW).reason
    both = [claim("a", 0, 2, since=1.0, moves_to=2), claim("b", 1, 2, since=2.0, moves_to=2)]
    assert winners(both) == ["a", "b"]  # one plan that fills stage 2 from both
    assert winners([claim("a", 0, 1, since=1.0), claim("b", 2, 3, since=2.0)]) == ["a", "b"]  # unrelated moves


def test_a_stage_gives_or_receives_never_both():
    assert winners([claim("a", 0, 1, since=1.0), claim("b", 1, 0, since=2.0)]) == ["a"]
    assert winners([claim("a", 0, 1, since=1.0), claim("b", 2, 0, since=2.0)]) == ["a"]  # into a donor
    assert winners([claim("a", 0, 1, since=1.0), claim("b", 1, 2, since=2.0)]) == ["a"]  # out of a receiver
    verdict = claim_verdict(claim("b", 1, 0, since=2.0), [claim("a", 0, 1, since=1.0)], NOW)
    assert "gives or receives peers, never both" in verdict.reason


def test_withdrawn_expired_and_own_earlier_claims_take_no_place():
    mine = claim("b", since=5.0)
    gone = [
        ClaimView("a", 0, 1, 1, 1, since=1.0, expires_at=NOW + 10, active=False),  # withdrawn
        ClaimView("c", 0, 1, 1, 1, since=1.0, expires_at=NOW),  # expired
        ClaimView("b", 0, 1, 1, 1, since=1.0, expires_at=NOW + 10),  # this peer's own older claim
    ]
    assert claim_verdict(mine, gone, NOW).wins


def test_a_claimed_move_says_how_many_moves_its_plan_makes_out_of_and_into_its_stages():
    # stage 1's peer is slow: the plan moves two of the four stage-0 peers there
    swarm = [ReplicaView(p, 0, 10.0, "online") for p in "abcd"] + [ReplicaView("e", 1, 1.0, "online")]
    decisions = [decide_move(p, swarm, 2) for p in "abcde"]
    moving = [d for d in decisions if d.move]
    assert len(moving) == 2 and all((d.moves_from, d.moves_to) == (2, 2) for d in moving)
    assert all((d.moves_from, d.moves_to) == (0, 0) for d in decisions if not d.move)


def _spec(from_stage: int, step: int, moves_from: int, moves_to: int, since: int) -> tuple:
    return from_stage, (from_stage + step) % 4, moves_from, moves_to, since


live_claims = st.lists(
    st.builds(
        _spec,
        st.integers(0, 3),
        st.integers(1, 3),
        st.integers(1, 3),
        st.integers(1, 3),
        st.integers(0, 5),  # few values: ties are common
    ),
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(live_claims)
def test_the_movers_never_exceed_any_movers_plan_and_no_stage_both_gives_and_receives(specs):
    claims = [ClaimView(f"p{i}", f, t, mf, mt, float(since), NOW + 10) for i, (f, t, mf, mt, since) in enumerate(specs)]
    moving = [c for c in claims if claim_verdict(c, claims, NOW).wins]
    for stage in range(4):
        leaving = [c for c in moving if c.from_stage == stage]
        entering = [c for c in moving if c.to_stage == stage]
        assert all(len(leaving) <= c.moves_from for c in leaving)
        assert all(len(entering) <= c.moves_to for c in entering)
        assert not (leaving and entering)
    if claims:  # the earliest claim always moves: a race never ends with nobody moving
        first = min(claims, key=lambda c: (c.since, c.peer_id))
        assert first in moving


class ClaimStore:
    """The DHT's move claims, in memory: what the peer loop stores and reads back."""

    def __init__(self, monkeypatch, *, wait_s: float, on_fetch=None) -> None:
        self.claims: dict[str, MoveClaim] = {}
        self.published: list[MoveClaim] = []
        self.on_fetch = on_fetch
        monkeypatch.setattr(stage_moves, "publish_move_claim_async", self.publish)
        monkeypatch.setattr(stage_moves, "fetch_move_claims_async", self.fetch)
        monkeypatch.setattr(stage_moves, "MOVE_CLAIM_WAIT_S", wait_s)

    async def publish(self, dht, claim, *, timeout_s):
        self.claims[claim.peer_id] = claim
        self.published.append(claim)
        return True

    async def fetch(self, dht, model, *, timeout_s):
        if self.on_fetch is not None:
            self.on_fetch()
        return list(self.claims.values())

    def withdrawn(self) -> set[str]:
        return {claim.peer_id for claim in self.published if not claim.active}


class HerdPeer(stage_moves.StageMoves):
    """A stage-0 peer of a 3:1 swarm whose every snapshot names itself the one mover (it sees
    itself slower than the others: throughputs swing between announcements)."""

    def __init__(self, peer_id: str, other: str) -> None:
        serving = SimpleNamespace(
            state=PeerState.ONLINE,
            requests_served=100,
            runtime=SimpleNamespace(stage=0, num_stages=2, throughput=SimpleNamespace(value=0.5)),
        )
        settings = PlacementSettings(rebalance_period_s=0.2, rebalance_loss_watch_s=0.0, rebalance_min_gain=0.2)
        super().__init__(
            serving, None, None, settings, peer_id=peer_id, model="tiny", builder=None, announcer=None, replicas=None
        )
        self.other, self.moved_to, self.stop = other, [], asyncio.Event()

    async def swarm_views(self, *, include_self: bool = True) -> list[ReplicaView]:
        others = [ReplicaView(self.other, 0, 1.0, "online"), ReplicaView("p1", 0, 1.0, "online")]
        others.append(ReplicaView("q1", 1, 1.0, "online"))
        return others + ([ReplicaView(self.peer_id, 0, 0.5, "online")] if include_self else [])

    async def move_to_stage(self, stage: int, p2p, seen_replicas=()) -> None:
        self.moved_to.append(stage)
        self.stop.set()  # (these scripted snapshots would not show the move)


def run_peers(peers: list[HerdPeer], seconds: float) -> None:
    async def run(peer):
        try:
            await asyncio.wait_for(peer.rebalance_forever(None, peer.stop), timeout=seconds)
        except TimeoutError:
            pass

    async def scenario():
        await asyncio.gather(*(run(peer) for peer in peers))

    asyncio.run(scenario())


def test_two_peers_that_each_plan_the_one_move_claim_it_and_only_one_moves(monkeypatch, capsys):
    """The peer loop (StageMoves.rebalance_forever) of two stage-0 peers, each of whose snapshots
    names itself the one mover, over an in-memory claim store: one moves, the other does not."""
    store = ClaimStore(monkeypatch, wait_s=0.5)  # longer than the spread of their first checks
    peers = [HerdPeer("a-peer", "b-peer"), HerdPeer("b-peer", "a-peer")]
    run_peers(peers, 2.0)
    out = capsys.readouterr().out
    assert sorted(len(peer.moved_to) for peer in peers) == [0, 1], out
    assert out.count("rebalancing: moving from stage 0 to stage 1") == 1, out
    assert "rebalancing: no move from stage 0 to stage 1, because peer(s)" in out, out
    loser = next(peer for peer in peers if not peer.moved_to)
    assert store.withdrawn() == {loser.peer_id}  # the winner's claim lapses on its own


def test_a_peer_stopped_while_it_reads_the_claims_back_withdraws_its_claim_and_does_not_move(monkeypatch):
    peer = HerdPeer("a-peer", "b-peer")
    store = ClaimStore(monkeypatch, wait_s=0.05, on_fetch=peer.stop.set)
    run_peers([peer], 2.0)
    assert peer.moved_to == [] and store.withdrawn() == {"a-peer"}
