"""Sync rounds in the group a trainer's commit names (`--averaging-groups trainer`): two replicas of
a stage, each a GradientSync with its own real hivemind DHT node and averager process, average
their gradients without matchmaking, weighted by the commit's sample counts."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch

from models.config import get_model_config
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from peers.replicas.averaging import GradientSync
from peers.replicas.averaging_members import NAMED_GROUP_WAIT_S

MATCHMAKING_S = 30.0  # a round by matchmaking could not end sooner than this: the named one must


def start_replicas(members: list[set[str] | None] | None = None):
    """Two replicas of stage 0, each with its DHT node; `members`: each one's member list (None:
    anyone), given as indexes into the two replicas."""
    first = hivemind.DHT(start=True)
    dhts = [first, hivemind.DHT(start=True, initial_peers=[str(a) for a in first.get_visible_maddrs()])]
    ids = [dht.peer_id.to_base58() for dht in dhts]
    syncs = []
    for seed, dht in enumerate(dhts):
        runtime = StageRuntime(get_model_config("tiny"), 0, 2, optimizer=OptimizerSettings(optimizer="sgd", lr=0.1))
        generator = torch.Generator().manual_seed(seed)
        samples = 2 + 2 * seed  # 2 and 4: unequal weights
        inputs = torch.randint(0, 256, (samples, runtime.config.seq_len), generator=generator)
        grad_outputs = torch.randn(samples, runtime.config.seq_len, runtime.config.d_model, generator=generator)
        runtime.backward("mb0", inputs, grad_outputs=grad_outputs)
        known = None if members is None or members[seed] is None else {ids[i] for i in members[seed]}
        syncs.append(
            GradientSync(
                runtime,
                dht,
                "tiny",
                timeout_s=2 * MATCHMAKING_S,
                matchmaking_s=MATCHMAKING_S,
                named_groups=True,
                members=known,
            )
        )
    return dhts, syncs


def stop_replicas(dhts, syncs) -> None:
    for sync in syncs:
        sync.shutdown()
    for dht in dhts:
        dht.shutdown()


@pytest.fixture
def replicas():
    dhts, syncs = start_replicas()
    yield syncs
    stop_replicas(dhts, syncs)


def test_two_replicas_average_in_the_group_the_commit_names_without_matchmaking(replicas):
    means = [[g.clone() for g in r.runtime.local_mean_gradients()] for r in replicas]
    weights = [r.runtime.samples_accumulated for r in replicas]
    samples = {r.averager.peer_id.to_base58(): w for r, w in zip(replicas, weights)}
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda r: r.average_gradients(2, samples, "run:0"), replicas))
    assert time.monotonic() - started < MATCHMAKING_S / 2, "the round waited for matchmaking"
    assert all(o.averaged and o.stepped and o.group_size == 2 and o.samples == sum(weights) for o in outcomes)
    expected = [(weights[0] * a + weights[1] * b) / sum(weights) for a, b in zip(*means)]
    for replica in replicas:
        for averaged, mean in zip(replica.averaged_gradients(), expected):
            torch.testing.assert_close(averaged, mean, atol=1e-6, rtol=1e-6)
    # no averager declared itself a state donor on the DHT (hivemind re-declares after every round)
    donors = replicas[0].averager.dht.get(f"{replicas[0].averager.prefix}.all_averagers", latest=True)
    assert donors is None, donors


def test_a_round_one_replica_refuses_fails_on_the_other_at_once_not_at_its_timeout():
    """The second replica does not count the first as a member (its member list lags behind the
    DHT, or the first has no credential), so it abandons the round the commit named. hivemind has
    no message for that: the first waited for the second's parts until its round's timeout (here
    60 s). Now the second answers the first's parts with an error, and the first ends its round as
    soon as it has one: both fail, nothing is averaged, within seconds."""
    dhts, syncs = start_replicas(members=[{1}, set()])
    try:
        samples = {s.averager.peer_id.to_base58(): s.runtime.samples_accumulated for s in syncs}
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda r: r.average_gradients(2, samples, "run:0"), syncs))
        elapsed = time.monotonic() - started
        assert [(o.averaged, o.stepped) for o in outcomes] == [(False, False), (False, False)], outcomes
        assert elapsed < NAMED_GROUP_WAIT_S, f"the refused round took {elapsed:.1f} s to fail"
        assert [s.failed_rounds for s in syncs] == [1, 1]
    finally:
        stop_replicas(dhts, syncs)
