"""--faults hold (peers/compute/faults.py): a peer holds one call mid-hop and says so, for the tests
that SIGKILL it at that moment (tests/integration/test_direct_routing.py)."""

import time

import pytest
import torch

from models.config import get_model_config
from peers.compute.faults import HOLD_MESSAGE, FaultSettings, FaultyStageRuntime
from peers.compute.stage_runtime import StageRuntime
from process.config import ConfigError


def test_fault_hold_holds_one_call_at_its_point_after_the_calls_it_lets_through(caplog):
    """--faults hold=forward|backward: the (after+1)th call at that point is held and logged, once;
    a last stage's fused forward+backward counts as the forward hop it answers."""
    config = get_model_config("tiny")
    x = torch.randint(0, config.vocab_size, (2, config.seq_len))
    grad = torch.randn(2, config.seq_len, config.d_model)
    held = FaultyStageRuntime(
        StageRuntime(config, 0, 2), FaultSettings(fault_hold="backward", fault_hold_after=1, fault_hold_s=0.3)
    )
    durations = []
    for microbatch in ("a", "b", "c"):
        held.forward(microbatch, x)  # never held: the hold is at the backward
        started = time.perf_counter()
        held.backward(microbatch, x, grad_outputs=grad)
        durations.append(time.perf_counter() - started)
    assert durations[1] >= 0.3  # the second backward, once
    assert caplog.text.count("injected by --faults hold") == 1
    assert HOLD_MESSAGE.format(microbatch_id="b", point="backward") in caplog.text
    last = FaultyStageRuntime(StageRuntime(config, 1, 2), FaultSettings(fault_hold="forward", fault_hold_s=0.3))
    started = time.perf_counter()
    last.backward("a", torch.randn(2, config.seq_len, config.d_model), targets=x)
    assert time.perf_counter() - started >= 0.3
    with pytest.raises(ConfigError):
        FaultSettings(fault_hold="sideways")
