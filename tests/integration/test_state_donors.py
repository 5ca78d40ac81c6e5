"""A joining replica never takes a state on one donor's word (issue #60): in an open run, a stranger
announces itself as a replica of stage 0 with 10^6 steps, an id ground to sort before the honest
replica's and no load, and serves a forged state (every parameter 0.5). Before, a credentialed
joiner loaded it, and the trainer's repair then copied it over the honest replica (1,000,020 steps)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from dht.announce import announce, fetch_stage_records
from dht.node import NetworkConfig, start_dht
from dht.records import PeerRecord, PeerState
from dht.signing import load_identity, new_identity_file
from models.config import get_model_config
from peers.compute.checkpoint import serialize_state
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from peers.replicas.state_transfer import snapshot_state
from tests.integration.test_replicas import run_trainer
from tests.integration.test_run_authority import Run
from wire.bounded_streams import StreamLimits, serve_bounded
from wire.messages import write_state
from wire.protocol import RPC_STATE, StateHeader

pytestmark = pytest.mark.slow

FORGED_STEPS = 10**6
TRAIN_ARGS = ["--batch-size", "4", "--microbatch-size", "2", "--refresh-period-s", "1"]


def forged_state() -> bytes:
    """Stage 0 of `tiny` in 2 stages with every parameter 0.5, claiming 10^6 steps."""
    runtime = StageRuntime(get_model_config("tiny"), 0, 2, optimizer=OptimizerSettings())
    with torch.no_grad():
        for param in runtime.module.parameters():
            param.fill_(0.5)
    meta, module_state, optimizer_state = snapshot_state(runtime, "tiny")
    return serialize_state(dataclasses.replace(meta, steps_done=FORGED_STEPS), module_state, optimizer_state)


def identity_sorting_before(tmp_path, other: str, tries: int = 200) -> str:
    """A key file whose peer id sorts before `other` (records are read sorted by subkey)."""
    for attempt in range(tries):
        path = str(tmp_path / f"forger{attempt}.key")
        new_identity_file(path)
        if load_identity(path).peer_id < other:
            return path
    raise AssertionError(f"no id sorting before {other} in {tries} tries")


def test_a_joiner_does_not_load_a_forged_state_and_the_repair_does_not_spread_it(make_swarm, tmp_path):
    run = Run(tmp_path, private=False)
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    honest = swarm.start_peer(0, *run.args("honest", "peer", stage=0))
    last = swarm.start_peer(1, *run.args("last", "peer", stage=1))
    swarm.wait_online([honest, last])
    trainer_args = run.args("trainer", "trainer")
    run_trainer(swarm, tmp_path, "--steps", "2", *TRAIN_ARGS, *trainer_args)

    forger = start_dht(
        NetworkConfig(
            initial_peers=swarm.initial_peers, identity_path=identity_sorting_before(tmp_path, run.ids["honest"])
        ),
    )
    data = forged_state()

    async def serve_forged_state(request, context):
        for message in write_state(StateHeader(total_bytes=len(data), steps_done=FORGED_STEPS), data):
            yield message

    async def stand_in():
        p2p = await forger.replicate_p2p()
        await serve_bounded(
            p2p, RPC_STATE, serve_forged_state, runtime_pb2.ExpertRequest, StreamLimits(), stream_input=False
        )
        record = PeerRecord(
            peer_id=forger.peer_id.to_base58(),
            model="tiny",
            stage=0,
            num_stages=2,
            state=PeerState.ONLINE,
            throughput=100.0,
            load=0.0,
            averaging="sync",
            steps_done=FORGED_STEPS,
            expires_at=get_dht_time() + 600,
        )
        assert await announce(forger, record)

    loop = asyncio.new_event_loop()  # the forger's handler runs on it, in a thread of this process
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(stand_in(), loop).result(timeout=60)
        joiner = swarm.start_peer(0, *run.args("joiner", "peer", stage=0))
        swarm.wait_online([joiner])
        loaded = re.search(r"loaded stage 0 state from replica (\S+) \((\d+) steps done", joiner.log())
        assert loaded, joiner.log()[-3000:]
        assert loaded.group(1) == run.ids["honest"][-8:] and int(loaded.group(2)) == 2, joiner.log()[-3000:]

        report = run_trainer(swarm, tmp_path, "--steps", "1", *TRAIN_ARGS, *trainer_args)
        assert report["completed"] and report["replica_catch_ups"] == 0, report
        reader = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
        try:
            deadline, steps = time.monotonic() + 60, {}
            while time.monotonic() < deadline:  # records are renewed every few seconds
                records = fetch_stage_records(reader, "tiny", 0)
                steps = {
                    r.peer_id: r.steps_done for r in records if r.peer_id in (run.ids["honest"], run.ids["joiner"])
                }
                if len(steps) == 2 and min(steps.values()) >= 3:
                    break
                time.sleep(1.0)
        finally:
            reader.shutdown()
        assert steps == {run.ids["honest"]: 3, run.ids["joiner"]: 3}, steps
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        forger.shutdown()


def test_a_lone_replica_s_state_gets_through_when_the_other_replicas_of_its_stage_just_joined(make_swarm, tmp_path):
    """Issue #60: a donor's step count is bounded by what the other live peers announce. Counted on
    its own stage only, a lone honest replica 20 steps in was refused once two fresh replicas (0 steps)
    were online beside it: a third joiner started from initial weights, and the trainer's repairs of
    the fresh ones were refused too. The run's other stage announces the same steps; it counts."""
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    first, last = swarm.start_peer(0), swarm.start_peer(1)
    swarm.wait_online([first, last])
    run_trainer(swarm, tmp_path, "--steps", "20", *TRAIN_ARGS)
    fresh = [swarm.start_peer(1, "--no-load-state") for _ in range(2)]
    swarm.wait_online(fresh)
    joiner = swarm.start_peer(1)
    swarm.wait_online([joiner])
    loaded = re.search(r"loaded stage 1 state from replica (\S+) \((\d+) steps done", joiner.log())
    assert loaded, joiner.log()[-3000:]
    assert int(loaded.group(2)) == 20, joiner.log()[-3000:]
