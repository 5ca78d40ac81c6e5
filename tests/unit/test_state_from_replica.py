"""Loading a stage's state from replicas: whose state is taken (never one donor's word), and into
which runtime."""

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from dht.records import PeerRecord, PeerState
from peers.compute.checkpoint import CheckpointError, CheckpointMeta
from peers.replicas import replica_sync
from peers.replicas.donor_choice import StateOffer, choose_donors, shuffled, state_digest, step_bound, steps_by_now
from peers.replicas.replica_sync import ReplicaSyncService


class FakeRuntime:
    def __init__(self, stage: int, steps_done: int):
        self.stage, self.num_stages, self.steps_done = stage, 2, steps_done
        self.module = torch.nn.Linear(2, 2)  # what bounds the state a replica may send
        self.imported = None

    def import_state(self, state, model_name, source):
        self.imported = state
        self.steps_done = state[0].steps_done


def replica(peer_id: str, stage: int, steps_done: int = 0) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        model="tiny",
        stage=stage,
        num_stages=2,
        state=PeerState.ONLINE,
        throughput=1.0,
        expires_at=1e12,
        steps_done=steps_done,
    )


class Donors:
    """Replicas that offer and send states: peer id -> (steps, digest); `asked`: the downloads, in order."""

    def __init__(self, states: dict[str, tuple[int, str]], gone: set[str] = frozenset()):
        self.states, self.gone, self.asked = states, gone, []

    async def offer(self, p2p, peer_id, request, *, timeout_s):
        if peer_id in self.gone or peer_id not in self.states:
            raise TimeoutError("no answer")
        steps, digest = self.states[peer_id]
        return StateOffer(peer_id, steps, digest)

    async def download(self, p2p, peer_id, request, *, timeout_s, max_bytes, expected_digest=None):
        assert max_bytes == 4 * (4 + 2) * 4 + (64 << 20)
        self.asked.append(peer_id)
        steps, digest = self.states[peer_id]
        if expected_digest is not None and digest != expected_digest:
            raise CheckpointError("another state than the one offered")
        return CheckpointMeta(model="tiny", stage=request.stage, num_stages=2, steps_done=steps), {}, {}


def load_into(runtime: FakeRuntime, records, donors: Donors, monkeypatch, **kwargs) -> bool:
    """A mover that served 9 steps of stage 0 loads `runtime` from replicas, the DHT and the state
    transfer replaced by `records` and `donors`."""
    monkeypatch.setattr(replica_sync, "fetch_stage_records_async", records)
    monkeypatch.setattr(replica_sync, "download_state", donors.download)
    monkeypatch.setattr(replica_sync, "fetch_offer", donors.offer)
    with ThreadPoolExecutor(max_workers=1) as executor:
        serving = SimpleNamespace(runtime=FakeRuntime(stage=0, steps_done=9))
        replicas = ReplicaSyncService(
            serving, executor, dht=None, peer_id="mover", model="tiny", averaging_timeout_s=1.0, rng=random.Random(0)
        )
        return asyncio.run(replicas.load_state_from_replica(None, runtime, **kwargs))


def test_a_moving_peer_loads_the_new_stage_whatever_its_old_stage_had_done(monkeypatch):
    """The replica's steps are compared with the runtime that receives them (the new stage's, fresh), not
    with the stage the peer served so far: a peer that had done 9 steps on stage 0 and moves to stage 1,
    whose replica has done 4, must take that state, not serve stage 1 from its initial weights."""

    async def records(dht, model, stage):
        return [replica("stage1-replica", stage, steps_done=4)]

    new_stage = FakeRuntime(stage=1, steps_done=0)
    assert load_into(new_stage, records, Donors({"stage1-replica": (4, "d4")}), monkeypatch)
    assert new_stage.steps_done == 4 and new_stage.imported is not None
    # A runtime that already holds more steps than the replica (a restored checkpoint) keeps its own.
    restored = FakeRuntime(stage=1, steps_done=7)
    assert not load_into(restored, records, Donors({"stage1-replica": (4, "d4")}), monkeypatch)
    assert restored.steps_done == 7 and restored.imported is None


def test_a_mover_asks_the_replica_its_plan_saw_when_that_replicas_record_lapsed(monkeypatch):
    """On a loaded machine a record renewed every second can lapse for a moment: the DHT then shows the
    stage no replica, and a mover that asked only the DHT served the stage from its initial weights
    (main's clean CI, stop 40). The replicas the move's plan saw are asked too, after the DHT's."""

    async def no_records(dht, model, stage):
        return []

    donors = Donors({"stage1-replica": (5, "d5")}, gone={"gone"})
    assert not load_into(FakeRuntime(stage=1, steps_done=0), no_records, donors, monkeypatch)
    assert donors.asked == []  # nothing seen, nothing on the DHT: nothing to ask
    new_stage = FakeRuntime(stage=1, steps_done=0)
    seen = ["mover", "gone", "stage1-replica", "gone"]
    assert load_into(new_stage, no_records, donors, monkeypatch, seen_replicas=seen)
    assert donors.asked == ["stage1-replica"] and new_stage.steps_done == 5


def test_a_forger_announcing_a_million_steps_is_not_a_donor_beside_an_honest_replica(monkeypatch):
    """Issue #60: a replica that exported every parameter at 0.5 with 10^6 steps was loaded, and the
    trainer's repair then copied it over the honest replica. No other live replica announces 10^6."""

    async def records(dht, model, stage):
        return [replica("forger", stage, steps_done=10**6), replica("honest", stage, steps_done=20)]

    donors = Donors({"forger": (10**6, "forged"), "honest": (21, "h21")})
    joiner = FakeRuntime(stage=0, steps_done=0)
    assert load_into(joiner, records, donors, monkeypatch)
    assert donors.asked == ["honest"] and joiner.steps_done == 21


def test_two_agreeing_replicas_outvote_a_forger_that_claims_a_step_more(monkeypatch):
    async def records(dht, model, stage):
        return [replica(p, stage, steps_done=20) for p in ("forger", "a", "b")]

    for seed in range(5):  # whatever the order they are asked in
        donors = Donors({"forger": (21, "forged"), "a": (20, "h20"), "b": (20, "h20")})
        joiner = FakeRuntime(stage=0, steps_done=0)
        monkeypatch.setattr(replica_sync.random, "SystemRandom", lambda: random.Random(seed))
        assert load_into(joiner, records, donors, monkeypatch)
        assert donors.asked[0] in ("a", "b") and joiner.steps_done == 20


def test_a_donor_that_sends_another_state_than_it_offered_is_refused(monkeypatch):
    async def records(dht, model, stage):
        return [replica(p, stage, steps_done=20) for p in ("a", "b")]

    class Switching(Donors):
        async def download(self, p2p, peer_id, request, **kwargs):
            if peer_id == "a":  # offered the agreed state, sends its own
                self.asked.append(peer_id)
                raise CheckpointError("another state than the one offered")
            return await super().download(p2p, peer_id, request, **kwargs)

    donors = Switching({"a": (20, "h20"), "b": (20, "h20")})
    joiner = FakeRuntime(stage=0, steps_done=0)
    assert load_into(joiner, records, donors, monkeypatch)
    assert donors.asked[-1] == "b" and joiner.steps_done == 20


def test_in_a_run_with_an_authority_only_credentialed_replicas_are_asked(monkeypatch):
    """A replica without a credential (an open run lets anyone serve) is never asked for state."""
    asked = []

    async def records(dht, model, stage):
        return [replica("stranger", stage, steps_done=3)]

    class Authority:
        def verify(self, *args, **kwargs):
            raise AssertionError("never reached: the record carries no credential")

    monkeypatch.setattr(replica_sync, "fetch_stage_records_async", records)

    async def offer(p2p, peer_id, request, *, timeout_s):
        asked.append(peer_id)
        return StateOffer(peer_id, 3, "d3")

    monkeypatch.setattr(replica_sync, "fetch_offer", offer)
    with ThreadPoolExecutor(max_workers=1) as executor:
        serving = SimpleNamespace(runtime=FakeRuntime(stage=0, steps_done=0))
        replicas = ReplicaSyncService(
            serving, executor, dht=None, peer_id="me", model="tiny", averaging_timeout_s=1.0, authority=Authority()
        )
        assert not asyncio.run(replicas.load_state_from_replica(None, seen_replicas=["stranger"]))
    assert asked == []


def test_the_donor_choice_prefers_agreement_near_the_most_trained_then_the_most_trained_within_the_bound():
    offers = [StateOffer("x", 30, "dx"), StateOffer("y", 25, "dy"), StateOffer("z", 25, "dy")]
    announced = {"x": 28, "y": 25, "z": 25}
    assert [o.peer_id for o in choose_donors(offers, 0, announced)] == ["y", "z"]  # two agree
    assert [o.peer_id for o in choose_donors(offers[:2], 0, announced)] == ["x"]  # no agreement: most trained
    assert choose_donors(offers, 26, announced) == [offers[0]]  # fewer steps than ours: not taken
    assert choose_donors([StateOffer("x", 10**6, "f")], 0, {"x": 10**6, "y": 20}) == []
    fresh = [StateOffer("a", 0, "d0"), StateOffer("b", 0, "d0"), StateOffer("h", 20, "dh")]
    assert choose_donors(fresh, 0, {"a": 0, "b": 0, "h": 20, "s0": 20}) == [
        fresh[2]
    ]  # joiners agree, the trained one wins
    assert len(choose_donors(fresh[:2] + [StateOffer("h", 16, "dh")], 0, {"a": 0, "b": 0, "h": 16, "s0": 16})) == 2
    assert step_bound("x", 0, {"x": 10**6}) == float("inf")  # a lone donor: its word is all there is
    assert step_bound("x", 40, {"x": 10**6, "y": 20}) == 40 + 16


def test_donors_are_asked_in_an_order_no_peer_id_steers():
    ids = [f"peer{i}" for i in range(8)]
    firsts = {shuffled(sorted(ids), random.Random(seed))[0] for seed in range(40)}
    assert len(firsts) > 4  # the id that sorts first is not the first asked every time


def test_the_state_digest_is_of_the_content_whatever_the_serialization():
    module = {"w": torch.arange(6.0).reshape(2, 3)}
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}}, "param_groups": [{"lr": 0.1}]}
    same = {"w": torch.arange(6.0).reshape(2, 3).clone()}
    assert state_digest(3, module, optimizer) == state_digest(3, same, optimizer)
    assert state_digest(3, module, optimizer) != state_digest(4, module, optimizer)
    assert state_digest(3, module, optimizer) != state_digest(3, {"w": torch.full((2, 3), 0.5)}, optimizer)
    with pytest.raises(AssertionError):
        assert state_digest(3, module, optimizer) == state_digest(3, {"w": module["w"].double()}, optimizer)


def test_without_an_authority_a_commit_may_name_only_live_sync_replicas(monkeypatch):
    """Issue #60: a commit declaring a group of 4,096 made-up peers held the compute thread 30 s."""
    from wire.protocol import CommitRequest, ProtocolError

    reads = []

    async def records(dht, model, stage):
        reads.append(stage)
        sync = replica("partner", stage).model_copy(update={"averaging": "sync"})
        return [sync, replica("idle", stage).model_copy(update={"averaging": "none"})]

    monkeypatch.setattr(replica_sync, "fetch_stage_records_async", records)
    serving = SimpleNamespace(runtime=FakeRuntime(stage=0, steps_done=0))
    replicas = ReplicaSyncService(serving, None, dht=None, peer_id="me", model="tiny", averaging_timeout_s=1.0)

    def commit(*names):
        return CommitRequest(
            model="tiny", stage=0, num_stages=2, step_id="s", group_size=len(names), samples=dict.fromkeys(names, 1)
        )

    asyncio.run(replicas.check_named_group(commit("me", "partner")))
    with pytest.raises(ProtocolError, match="names 2 peer"):
        asyncio.run(replicas.check_named_group(commit("me", "partner", "idle", "made-up")))
    assert len(reads) == 2  # read once, and once more before refusing (a replica may have just joined)


def test_in_a_run_a_mover_asks_a_seen_replica_it_saw_holding_a_credential(monkeypatch, tmp_path):
    """The seen-replicas fallback (a record that lapsed a moment) holds in a run too, for members."""
    from dht.authority import RunAuthority, create_run, issue, load_owner_key
    from dht.signing import load_identity, new_identity_file

    run = create_run(str(tmp_path / "run"), private=False)
    authority = RunAuthority(run)
    new_identity_file(str(tmp_path / "m.key"))
    member = load_identity(str(tmp_path / "m.key")).peer_id
    signed = issue(
        load_owner_key(str(tmp_path / "run"), run), run, role="peer", peer_id=member, stage=1, valid_for_s=60
    )
    record = replica(member, 1, steps_done=5).model_copy(update={"credential": signed.to_bytes().decode()})

    async def no_records(dht, model, stage):
        return []

    donors = Donors({member: (5, "d5"), "stranger": (5, "d5")})
    monkeypatch.setattr(replica_sync, "fetch_stage_records_async", no_records)
    monkeypatch.setattr(replica_sync, "download_state", donors.download)
    monkeypatch.setattr(replica_sync, "fetch_offer", donors.offer)
    with ThreadPoolExecutor(max_workers=1) as executor:
        serving = SimpleNamespace(runtime=FakeRuntime(stage=0, steps_done=0))
        replicas = ReplicaSyncService(
            serving, executor, dht=None, peer_id="me", model="tiny", averaging_timeout_s=1.0, authority=authority
        )
        replicas.remember_members([record, replica("stranger", 1)])  # the plan's look
        new_stage = FakeRuntime(stage=1, steps_done=0)
        assert asyncio.run(replicas.load_state_from_replica(None, new_stage, seen_replicas=["stranger", member]))
    assert donors.asked == [member] and new_stage.steps_done == 5


def test_a_record_s_steps_are_carried_forward_by_its_age_at_twice_its_rate():
    assert steps_by_now(100, 10.0, 1000.0, 1015.0, now=1003.0) == 100 + 60
    assert steps_by_now(100, 10.0, 1000.0, 1015.0, now=2000.0) == 100 + 300  # no older than its lifetime
    assert steps_by_now(100, 10.0, 1000.0, 1015.0, now=990.0) == 100  # a clock ahead counts no age
    assert steps_by_now(100, 10.0, 0.0, 1015.0, now=1003.0) == 100  # it does not say when it was made
