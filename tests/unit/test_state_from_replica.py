"""Loading a stage's state from a replica: which replica's state is taken, and into which runtime."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from dht.records import PeerRecord, PeerState
from peers.compute.checkpoint import CheckpointMeta
from peers.replicas import replica_sync
from peers.replicas.replica_sync import ReplicaSyncService


class FakeRuntime:
    def __init__(self, stage: int, steps_done: int):
        self.stage, self.num_stages, self.steps_done = stage, 2, steps_done
        self.module = torch.nn.Linear(2, 2)  # what bounds the state a replica may send
        self.imported = None

    def import_state(self, state, model_name, source):
        self.imported = state
        self.steps_done = state[0].steps_done


def replica(peer_id: str, stage: int) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        model="tiny",
        stage=stage,
        num_stages=2,
        state=PeerState.ONLINE,
        throughput=1.0,
        expires_at=1e12,
    )


def load_into(runtime: FakeRuntime, records, download, monkeypatch, **kwargs) -> bool:
    """A mover that served 9 steps of stage 0 loads `runtime` from a replica, the DHT and the state
    transfer replaced by `records` and `download`."""
    monkeypatch.setattr(replica_sync, "fetch_stage_records_async", records)
    monkeypatch.setattr(replica_sync, "download_state", download)
    with ThreadPoolExecutor(max_workers=1) as executor:
        serving = SimpleNamespace(runtime=FakeRuntime(stage=0, steps_done=9))
        replicas = ReplicaSyncService(
            serving, executor, dht=None, peer_id="mover", model="tiny", averaging_timeout_s=1.0
        )
        return asyncio.run(replicas.load_state_from_replica(None, runtime, **kwargs))


def test_a_moving_peer_loads_the_new_stage_whatever_its_old_stage_had_done(monkeypatch):
    """The replica's steps are compared with the runtime that receives them (the new stage's, fresh), not
    with the stage the peer served so far: a peer that had done 9 steps on stage 0 and moves to stage 1,
    whose replica has done 4, must take that state, not serve stage 1 from its initial weights."""

    async def records(dht, model, stage):
        return [replica("stage1-replica", stage)]

    async def download(p2p, peer_id, request, *, timeout_s, max_bytes):
        assert max_bytes == 4 * (4 + 2) * 4 + (64 << 20)
        return CheckpointMeta(model="tiny", stage=request.stage, num_stages=2, steps_done=4), {}, {}

    new_stage = FakeRuntime(stage=1, steps_done=0)
    assert load_into(new_stage, records, download, monkeypatch)
    assert new_stage.steps_done == 4 and new_stage.imported is not None
    # A runtime that already holds more steps than the replica (a restored checkpoint) keeps its own.
    restored = FakeRuntime(stage=1, steps_done=7)
    assert not load_into(restored, records, download, monkeypatch)
    assert restored.steps_done == 7 and restored.imported is None


def test_a_mover_asks_the_replica_its_plan_saw_when_that_replicas_record_lapsed(monkeypatch):
    """On a loaded machine a record renewed every second can lapse for a moment: the DHT then shows the
    stage no replica, and a mover that asked only the DHT served the stage from its initial weights
    (main's clean CI, stop 40). The replicas the move's plan saw are asked too, after the DHT's."""
    asked = []

    async def no_records(dht, model, stage):
        return []

    async def download(p2p, peer_id, request, *, timeout_s, max_bytes):
        asked.append(peer_id)
        if peer_id == "gone":
            raise TimeoutError("no answer")
        return CheckpointMeta(model="tiny", stage=request.stage, num_stages=2, steps_done=5), {}, {}

    assert not load_into(FakeRuntime(stage=1, steps_done=0), no_records, download, monkeypatch)
    assert asked == []  # nothing seen, nothing on the DHT: nothing to ask
    new_stage = FakeRuntime(stage=1, steps_done=0)
    seen = ["mover", "gone", "stage1-replica", "gone"]
    assert load_into(new_stage, no_records, download, monkeypatch, seen_replicas=seen)
    assert asked == ["gone", "stage1-replica"] and new_stage.steps_done == 5
