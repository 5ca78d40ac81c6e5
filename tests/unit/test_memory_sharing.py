"""hivemind's shared memory passes between processes as file descriptors (dht/node.py), so that no
process of the swarm starts a torch_shm_manager (a binary that loads libtorch: about 0.5 s of CPU)."""

from __future__ import annotations

import os

import psutil
import pytest
import torch.multiprocessing
from hivemind.utils.mpfuture import MPFuture

import dht.node  # noqa: F401 - selects the strategy at import, as every process of the swarm does


@pytest.mark.skipif("HIVEMIND_MEMORY_SHARING_STRATEGY" in os.environ, reason="set: the user's strategy decides")
def test_hivemind_futures_share_their_state_without_a_manager_process():
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    futures = [MPFuture() for _ in range(17)]  # hivemind shares a new buffer every 16 futures
    for value, future in enumerate(futures):
        future.set_result(value)
    assert [future.result() for future in futures] == list(range(17))
    managers = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("torch_shm")]
    assert not managers, managers
