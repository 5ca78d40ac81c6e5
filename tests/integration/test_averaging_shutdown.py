"""A peer that stops while a thread waits in an averaging round: the round is cancelled and the
thread returns at once, not at the round's timeout (real hivemind DHT and averager process)."""

from __future__ import annotations

import os
import threading
import time

import hivemind
import psutil
import pytest
from hivemind.utils.mpfuture import MPFuture

from models.config import get_model_config
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from peers.replicas import averaging
from peers.replicas.averaging import GradientSync
from peers.replicas.delayed_sync import DelayedGradientSync

TIMEOUT_S = 60.0  # the round's timeout: far longer than the test may wait


@pytest.fixture
def dht():  # one per test: hivemind's DHT process died, now and then, receiving the pipe of a second averager
    dht = hivemind.DHT(start=True)
    yield dht
    dht.shutdown()


def _runtime() -> StageRuntime:
    return StageRuntime(get_model_config("tiny"), 0, 2, optimizer=OptimizerSettings(optimizer="sgd", lr=0.1))


def _in_thread(target) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        started = time.monotonic()
        result["value"] = target()
        result["waited_s"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("kind", [GradientSync, DelayedGradientSync], ids=["exact", "delayed"])
def test_a_commit_waiting_for_a_partner_returns_as_soon_as_the_averaging_shuts_down(dht, kind):
    sync = kind(_runtime(), dht, "tiny", timeout_s=TIMEOUT_S)
    try:
        if kind is DelayedGradientSync:
            sync.commit("run:0", group_size=2)  # starts a round that no partner will join
            assert sync.in_flight is not None and sync.in_flight.control is not None
            # the delayed commit's RPC handler waits for the round off the compute thread
            thread, result = _in_thread(lambda: sync.wait_in_flight())
        else:
            thread, result = _in_thread(lambda: sync.commit("run:0", group_size=2))
        time.sleep(1.0)
        assert thread.is_alive(), "the round ended before the shutdown: nothing was tested"
    finally:
        sync.shutdown()
    thread.join(timeout=15.0)
    assert not thread.is_alive(), f"still waiting in the round {TIMEOUT_S:.0f} s long after the shutdown"
    assert result["waited_s"] < 15.0
    if kind is GradientSync:
        assert result["value"].stepped is False and sync.runtime.steps_done == 0
    assert sync.open_rounds == set()


def test_an_averager_whose_dht_is_gone_fails_in_one_line_instead_of_waiting_forever():
    dht = hivemind.DHT(start=True)
    dht.kill()  # died (as seen: a pipe it was sent broke), not shut down: its pipe stays open and silent
    dht.join()
    # Killed just after it answered "ready", it may have died holding hivemind's MPFuture update lock,
    # a semaphore every process forked from this one shares: the next DHT this test session forks
    # then waits on it forever (seen in CI: two tests hung 300 s each). New locks for what follows.
    MPFuture.reset_backend()
    started = time.monotonic()
    with pytest.raises(averaging.AveragerDidNotStart, match="the DHT process is not running"):
        GradientSync(_runtime(), dht, "tiny", timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < 30.0


def test_a_stopped_averager_leaves_no_socket_behind(dht):
    """The averager's process opens its own client of p2pd; hivemind never closed it, so each
    averager that ran left `/tmp/hivemind-p2pclient-*.sock` behind (peers/replicas/averaging_members.py)."""
    sync = GradientSync(_runtime(), dht, "tiny", timeout_s=TIMEOUT_S)
    try:
        connections = psutil.Process(sync.averager.pid).net_connections(kind="unix")
        sockets = [c.laddr for c in connections if "hivemind-p2pclient-" in c.laddr]
        assert len(sockets) == 1, connections
    finally:
        sync.shutdown()
    assert not os.path.exists(sockets[0])
