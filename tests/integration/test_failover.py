"""Stochastic wiring and failover with real processes on loopback: kills, slow replicas, joins."""

from __future__ import annotations

import json
import re
import signal

import pytest

from swarm.local_swarm import fault_args
from tests.integration.polling import trainer_step, wait_for

pytestmark = pytest.mark.slow


def peer_key(process) -> str:
    """The short peer id the trainer's report uses (last 8 characters)."""
    match = re.search(r"peer (\S+) online", process.log())
    assert match, process.log()
    return match.group(1)[-8:]


def test_sigkill_of_a_replica_loses_nothing(make_swarm, tmp_path):
    # Routing failover, not averaging: with the default sync averaging much of each step is the
    # replicas' all-reduce at the commit, when no microbatch is in flight for the kill to hit.
    swarm = make_swarm(num_stages=2, peer_args=["--target-batch-size", "8", "--lr", "3e-3", "--averaging", "none"])
    swarm.start_bootstrap()
    peers = [swarm.start_peer(stage) for stage in (0, 0, 1, 1)]
    swarm.wait_online(peers)
    report_path = tmp_path / "report.json"
    trainer = swarm.start_trainer(
        "--steps",
        "40",
        "--batch-size",
        "8",
        "--microbatch-size",
        "2",
        "--num-stages",
        "2",
        "--refresh-period-s",
        "1",
        "--report",
        str(report_path),
    )
    wait_for(lambda: trainer_step(trainer) >= 8, 120, "the trainer to reach step 8", while_running=[trainer])
    victim = peers[2]
    victim.signal(signal.SIGKILL)
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    report = json.loads(report_path.read_text())
    assert report["completed"] and report["steps"] == 40
    assert report["microbatches_lost"] == 0
    assert report["microbatches_retried"] > 0, "the kill should have forced retries"
    assert report["microbatches_sent"] == 40 * 4
    # ...killed mid-call over the data plane (wire/data_plane.py), which carried the trainer's calls
    transports = report["transports"]
    assert transports["direct"]["calls"] > transports.get("p2pd", {}).get("calls", 0), transports
    losses = report["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses
    killed_calls_after = report["calls_by_peer"].get(peer_key(victim), 0)
    survivor_calls = report["calls_by_peer"][peer_key(peers[3])]
    assert survivor_calls > killed_calls_after


def test_a_replica_slowed_3x_gets_clearly_less_and_nothing_is_lost(make_swarm, tmp_path):
    """The trainer judges a replica by the time the peer reports it spent computing (or on the wire,
    if longer), not by round trips that also hold its wait behind our other requests, and its first
    own measurement replaces the throughput the peer announced at start-up.

    Behaviour only: the slowed replica gets clearly fewer calls than its partner (under half), still
    gets some (stochastic wiring never starves a live replica), and every microbatch is served. How
    close its share comes to the ideal third is a timing, measured by benchmarks/slowed_replica.py
    (a loaded CI run once put this ratio outside +-20% of a third when it was asserted here).

    The slowed peer spends its extra time computing (`--faults slowdown_mode=busy`), so load that
    hits both peers alike leaves it 3x slower than its partner. Hub routing: the trainer times each
    stage's call itself. Under direct routing it times whole chains, whose other stages and queues are in both
    replicas' chains alike (the slowed one drew about half its partner's calls, benchmarks/slowed_replica.py)."""
    swarm = make_swarm(model="small", num_stages=2, peer_args=["--target-batch-size", "8"])
    swarm.start_bootstrap()
    first = swarm.start_peer(0)
    fast = swarm.start_peer(1)
    slow = swarm.start_peer(1, *fault_args(slowdown=3, slowdown_mode="busy"))
    swarm.wait_online([first, fast, slow])
    report_path = tmp_path / "report.json"
    # Counted after a warm-up: a peer's first calls pay one-off costs (allocations, first-time code
    # paths; the busy slowdown triples them), and the slowed peer is judged by them for a while.
    warmup_steps, counted_steps = 3, 12
    trainer = swarm.start_trainer(
        *("--steps", str(warmup_steps + counted_steps), "--batch-size", "8", "--microbatch-size", "1"),
        *("--max-in-flight", "4", "--num-stages", "2", "--report", str(report_path), "--routing", "hub"),
    )
    after_warmup = wait_for(
        lambda: report_from_step(report_path, warmup_steps, trainer),
        300,
        f"the trainer to finish step {warmup_steps}",
        poll_s=0.05,
    )
    assert trainer.popen.wait(timeout=600) == 0, trainer.log()[-3000:]
    final = json.loads(report_path.read_text())
    window_steps = final["steps"] - after_warmup["steps"]
    assert window_steps >= counted_steps - 2, (after_warmup["steps"], final["steps"])  # the poll saw step 3-5
    calls = {peer: n - after_warmup["calls_by_peer"].get(peer, 0) for peer, n in final["calls_by_peer"].items()}
    slow_calls, fast_calls = calls[peer_key(slow)], calls[peer_key(fast)]
    print(f"slowed replica: {slow_calls} calls vs {fast_calls} over steps {after_warmup['steps'] + 1}-{final['steps']}")
    assert slow_calls + fast_calls == window_steps * 8, calls  # every stage-1 call is one of theirs
    assert 0 < slow_calls < fast_calls / 2, calls
    assert final["microbatches_lost"] == 0 and final["microbatches_sent"] == final["steps"] * 8, final


def report_from_step(report_path, step: int, trainer) -> dict | None:
    """The trainer's report once it has finished `step` (None before); fails if the trainer died."""
    if report_path.exists():
        report = json.loads(report_path.read_text())  # written atomically
        if report["steps"] >= step:
            return report
    assert trainer.alive, trainer.log()[-3000:]
    return None


def test_a_peer_that_joins_mid_run_is_served_requests_without_a_long_ban(make_swarm, tmp_path):
    """Measured by the new peer itself: from the moment its online record is stored to its first
    request. The trainer re-reads the DHT every refresh period (start to start), so on a quiet
    machine that is one period and a lookup (runs: 1.2-2.4 s with a 2 s period, see RESULTS.md).
    Behaviour, not a timing: the bound is five periods, well above what load adds, and well below
    what a call that failed on a glitch used to cost (a 15 s ban, which is what a 16 s delay was)."""
    refresh_s = 2.0
    swarm = make_swarm(num_stages=2, peer_args=["--target-batch-size", "8"])
    swarm.start_bootstrap()
    peers = [swarm.start_peer(0), swarm.start_peer(1)]
    swarm.wait_online(peers)
    trainer = swarm.start_trainer(
        "--steps",
        "100000",
        "--batch-size",
        "8",
        "--microbatch-size",
        "2",
        "--num-stages",
        "2",
        "--refresh-period-s",
        str(refresh_s),
    )
    wait_for(lambda: trainer_step(trainer) >= 3, 120, "the trainer to start", while_running=[trainer])
    newcomer = swarm.start_peer(1)
    swarm.wait_online([newcomer])
    served = wait_for(
        lambda: re.search(r"first request served ([\d.]+) s after the online record was stored", newcomer.log()),
        60,
        "the new peer to serve a request",
        while_running=[trainer, newcomer],
    )
    delay_s = float(served.group(1))
    print(f"joined peer's first request {delay_s:.2f} s after its online record (bound {5 * refresh_s:.1f} s)")
    assert delay_s < 5 * refresh_s, newcomer.log()
    assert peer_key(newcomer) in trainer.log()  # the trainer said that it saw the peer join
    assert trainer.alive
