"""The live planner on a real swarm: peers on loopback probe each other and publish their links;
`swarm plan --from-dht` plans for exactly those peers and publishes a plan the peers can read."""

from __future__ import annotations

import json
import re
import subprocess
import time

import numpy as np
import pytest
from hivemind.utils import get_dht_time

from dht.announce import fetch_stage_records
from dht.link_records import fetch_link_records
from dht.node import NetworkConfig, start_dht
from dht.plan_record import PlanRecord, fetch_plan, publish_plan, stage_in_plan
from dht.signing import load_identity, new_identity_file
from swarm.planner.cost import evaluate_plan, pair_costs
from swarm.planner.topology import load_topology

pytestmark = pytest.mark.slow


def peer_id_of(process) -> str:
    match = re.search(r"peer (\S+) online", process.log())
    assert match, process.log()[-2000:]
    return match.group(1)


def run_plan(swarm_cli, swarm, *args: str) -> subprocess.CompletedProcess:
    return swarm_cli(
        "plan", "--from-dht", "--initial-peers", *swarm.initial_peers, "--model", "tiny", *args, timeout=120
    )


def test_peers_measure_links_and_plan_from_dht_places_exactly_them(make_swarm, tmp_path, swarm_cli):
    swarm = make_swarm(num_stages=2, peer_args=["--link-probe-period-s", "1", "--metrics-port", "-1"])
    swarm.start_bootstrap()
    processes = [swarm.start_peer(stage) for stage in (0, 0, 1, 1)]
    swarm.wait_online(processes)
    peers = {peer_id_of(p) for p in processes}

    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
    try:
        # Every peer measures every other within a few probe rounds (each round probes up to 8).
        deadline, records = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            records = fetch_link_records(dht, "tiny")
            if {r.peer_id for r in records} == peers and all(set(r.links) == peers - {r.peer_id} for r in records):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"links not all measured within 60 s: {[(r.peer_id[-6:], sorted(r.links)) for r in records]}")
        for record in records:
            assert record.num_stages == 2 and record.stage in (0, 1) and record.throughput > 0
            for link in record.links.values():
                assert 0 < link.rtt_ms < 1000 and link.bandwidth_gbps > 0.01  # loopback: well under a second

        out, topology_file = tmp_path / "plan.json", tmp_path / "measured.json"
        completed = run_plan(
            swarm_cli,
            swarm,
            "--out",
            str(out),
            "--publish",
            "--time-limit-s",
            "5",
            "--save-topology",
            str(topology_file),
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        assert "6 of 6 pairs measured" in completed.stdout and "0 estimated" in completed.stdout

        plan = json.loads(out.read_text())
        assert len(plan["stage_peers"]) == 2 and all(len(group) == 2 for group in plan["stage_peers"])
        assert {peer for group in plan["stage_peers"] for peer in group} == peers
        assert plan["spares"] == [] and plan["estimated_pairs"] == []
        # The written cost is the cost model's for the written groups on the measured topology.
        cost = evaluate_plan(pair_costs(load_topology(topology_file)), np.array(plan["groups"]))
        assert plan["cost"]["total_s"] == pytest.approx(cost.total_s)

        published = fetch_plan(dht, "tiny")
        assert published is not None
        assert [list(group) for group in published.stages] == plan["stage_peers"]
        for stage, group in enumerate(plan["stage_peers"]):
            for peer in group:
                assert stage_in_plan(published, peer) == stage
    finally:
        dht.shutdown()

    # A model nobody serves: a one-line error, no traceback.
    completed = run_plan(swarm_cli, swarm, "--model", "small")
    assert completed.returncode == 2
    assert "no peer of small has published link records" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_a_peer_started_with_stage_auto_joins_the_stage_the_published_plan_names(make_swarm, tmp_path):
    """Stage 1 has no replica, so the greedy choice of `--stage auto` is stage 1 (the control peer
    shows it); a published plan that names the newcomer on stage 0 wins over it."""
    swarm = make_swarm(num_stages=2, peer_args=["--metrics-port", "-1"])
    swarm.start_bootstrap()
    first = swarm.start_peer(0)
    swarm.wait_online([first])
    identity = str(tmp_path / "newcomer.key")
    new_identity_file(identity)
    newcomer_id = load_identity(identity).peer_id

    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
    try:
        now = get_dht_time()
        plan = PlanRecord(
            model="tiny",
            num_stages=2,
            stages=((peer_id_of(first), newcomer_id), ("QmPlannedPeerNotStarted",)),
            total_s=1.0,
            data_parallel_s=0.25,
            pipeline_s=0.75,
            planner_id=dht.peer_id.to_base58(),
            created_at=now,
            expires_at=now + 300,
        )
        assert publish_plan(dht, plan)
        assert stage_in_plan(fetch_plan(dht, "tiny"), newcomer_id) == 0

        # Both at once: whichever reads the DHT first, stage 1 has no replica for the greedy choice.
        newcomer = swarm.start_peer("auto", "--identity-path", identity, name="newcomer")
        control = swarm.start_peer("auto", name="control")  # not in the plan: the greedy choice
        swarm.wait_online([newcomer, control])
        assert peer_id_of(newcomer) == newcomer_id
        assert "auto: the published plan puts this peer on stage 0" in newcomer.log()
        assert "auto: joining stage 0" in newcomer.log()
        assert "published plan" not in control.log() and "auto: joining stage 1" in control.log()

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            on_stage_0 = {r.peer_id for r in fetch_stage_records(dht, "tiny", 0)}
            if newcomer_id in on_stage_0:
                break
            time.sleep(0.5)
        assert newcomer_id in on_stage_0, "the newcomer does not announce itself on stage 0"
    finally:
        dht.shutdown()
