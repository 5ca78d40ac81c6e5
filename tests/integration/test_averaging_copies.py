"""Averaging through CPU copies. hivemind's averager all-reduces CPU tensors, one message per part of
each, so every peer hands it one flat CPU buffer: its gradients' (`GradientSync`) or a copy of its
parameters, taken before each periodic round and written back after it (`ParameterAveraging`). The
same path serves a stage on a GPU; CI has none, so these run it on the CPU, two replicas each with
its own real hivemind DHT node and averager process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch

from models.config import get_model_config
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from peers.replicas.averaging import GradientSync, ParameterAveraging
from peers.replicas.averaging_schedule import AveragingSchedule

pytestmark = pytest.mark.slow
MATCHMAKING_S = 1.0


@pytest.fixture
def dhts():
    first = hivemind.DHT(start=True)
    nodes = [first, hivemind.DHT(start=True, initial_peers=[str(a) for a in first.get_visible_maddrs()])]
    yield nodes
    for dht in nodes:
        dht.shutdown()


def accumulate(runtime: StageRuntime, microbatch: str, seed: int) -> None:
    """One backward of two random samples."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 256, (2, runtime.config.seq_len), generator=generator)
    grad_outputs = torch.randn(2, runtime.config.seq_len, runtime.config.d_model, generator=generator)
    runtime.backward(microbatch, inputs, grad_outputs=grad_outputs)


def trained_runtime(seed: int) -> StageRuntime:
    """Stage 0 of `tiny` with one backward accumulated, different for each seed."""
    runtime = StageRuntime(
        get_model_config("tiny"), 0, 2, seed=seed, optimizer=OptimizerSettings(optimizer="sgd", lr=0.1)
    )
    accumulate(runtime, "mb0", seed)
    return runtime


def test_periodic_rounds_through_a_flat_cpu_copy_write_the_mean_back_into_the_parameters(dhts):
    runtimes = [trained_runtime(seed) for seed in (0, 1)]
    for runtime in runtimes:
        runtime.step()  # the replicas' parameters now differ
    memory = [[p.data_ptr() for p in r.params] for r in runtimes]
    averagings = [
        ParameterAveraging(
            runtime,
            dht,
            "tiny",
            schedule=AveragingSchedule(every_steps=1),
            timeout_s=30.0,
            matchmaking_s=MATCHMAKING_S,
        )
        for runtime, dht in zip(runtimes, dhts)
    ]
    try:
        with averagings[0].averager.get_tensors() as (flat,):  # one flat copy, a view per parameter
            assert flat.numel() == sum(p.numel() for p in runtimes[0].params)
            assert all(
                c.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for c in averagings[0].buffers
            )
            assert all(c.data_ptr() != p.data_ptr() for c, p in zip(averagings[0].buffers, runtimes[0].params))
        for runtime in runtimes:  # after the copies were made: the round must average these values
            with torch.no_grad():
                for param in runtime.params:
                    param.add_(1.0)
        expected = [(a.detach() + b.detach()) / 2 for a, b in zip(runtimes[0].params, runtimes[1].params)]
        with ThreadPoolExecutor(2) as pool:  # nothing accumulated: the commit counts an empty step, then averages
            outcomes = list(pool.map(lambda a: a.commit("run:1", 2), averagings))
        assert all(o.averaged and o.group_size == 2 for o in outcomes), outcomes
        for runtime in runtimes:  # different inits before the round: far apart
            for param, mean in zip(runtime.params, expected):
                torch.testing.assert_close(param.detach(), mean, atol=1e-4, rtol=1e-5)
        assert [[p.data_ptr() for p in r.params] for r in runtimes] == memory, "the parameters were replaced"
    finally:
        for averaging in averagings:
            averaging.shutdown()


def test_gradient_buffers_are_cpu_copies_and_the_mean_comes_back_on_the_stage_device(dhts):
    runtimes = [trained_runtime(seed) for seed in (0, 1)]
    syncs = [
        GradientSync(r, dht, "tiny", timeout_s=30.0, matchmaking_s=MATCHMAKING_S) for r, dht in zip(runtimes, dhts)
    ]
    try:
        assert all(b.device.type == "cpu" for s in syncs for b in s.buffers)
        assert all(b.data_ptr() != p.data_ptr() for b, p in zip(syncs[0].buffers, runtimes[0].params))
        for sync in syncs:  # one flat tensor for hivemind (a message per part, not per parameter)
            with sync.averager.get_tensors() as averaged_tensors:
                (flat,) = averaged_tensors
                assert flat.numel() == sum(p.numel() for p in sync.runtime.params)
                assert [b.shape for b in sync.buffers] == [p.shape for p in sync.runtime.params]
                assert all(b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for b in sync.buffers)
        means = [[g.clone() for g in r.local_mean_gradients()] for r in runtimes]
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda s: s.average_gradients(2, None), syncs))
        assert all(o.averaged and o.stepped for o in outcomes), outcomes
        for sync in syncs:
            averaged = sync.averaged_gradients()
            assert all(g.device == sync.runtime.device for g in averaged)
            with sync.held_buffers() as buffers:  # a copy: stepping on it leaves the buffers alone
                assert all(g.data_ptr() != b.data_ptr() for g, b in zip(averaged, buffers))
            for got, a, b in zip(averaged, *means):
                torch.testing.assert_close(got, (a + b) / 2, atol=1e-6, rtol=0)
    finally:
        for sync in syncs:
            sync.shutdown()
