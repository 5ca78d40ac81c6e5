"""A replica's state answers cost little (issue #30): rate-limited per caller, serialized once per
step off the compute thread (which only copies the tensors), shared by concurrent requests."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from peers.compute.checkpoint import deserialize_state
from peers.replicas.donor_choice import state_digest
from peers.replicas.state_transfer import StateExports


class Runtime:
    def __init__(self) -> None:
        self.stage, self.num_stages, self.steps_done = 1, 2, 0
        self.module = torch.nn.Linear(8, 8)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=0.1)

    def optimizer_state(self) -> dict:  # as StageRuntime's, without a replica state
        return self.optimizer.state_dict()

    def step(self) -> None:
        self.module(torch.randn(4, 8)).sum().backward()
        self.optimizer.step()
        self.steps_done += 1


class RecordingExecutor(ThreadPoolExecutor):
    """The compute thread: records what runs on it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.ran: list[str] = []

    def submit(self, fn, *args, **kwargs):
        self.ran.append(fn.__name__)
        return super().submit(fn, *args, **kwargs)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_state_is_serialized_once_per_step_and_off_the_compute_thread():
    runtime, compute, exports = Runtime(), RecordingExecutor(), StateExports()

    async def run():
        first = await asyncio.gather(*(exports.export(runtime, "tiny", compute) for _ in range(3)))
        runtime.step()
        second = await exports.export(runtime, "tiny", compute)
        return first, second

    try:
        (first, second) = asyncio.run(run())
    finally:
        compute.shutdown()
    assert exports.exports == 2  # three concurrent requests shared one export; a step made a new one
    assert compute.ran == ["snapshot_state", "snapshot_state"]  # serializing ran elsewhere
    assert len({data for data, _, _ in first}) == 1 and [steps for _, steps, _ in first] == [0, 0, 0]
    meta, module_state, optimizer_state = deserialize_state(second[0])
    assert meta.steps_done == second[1] == 1
    assert second[2] == state_digest(1, module_state, optimizer_state) != first[0][2]  # what a joiner checks
    assert torch.equal(module_state["weight"], runtime.module.weight.detach())
    assert optimizer_state["state"][0]["step"] == 1


def test_a_caller_asking_again_and_again_is_refused_until_its_allowance_refills():
    clock = Clock()
    exports = StateExports(burst=2, refill_per_s=1 / 30, clock=clock)  # the defaults are 4 and 1 / 10
    assert exports.refusal("a") is None and exports.refusal("a") is None
    assert "too many state requests" in exports.refusal("a")
    assert exports.refusal("b") is None  # per caller
    clock.now += 31
    assert exports.refusal("a") is None
    assert "ask again in 29 s" in exports.refusal("a")  # 31 s refilled a little more than one request
