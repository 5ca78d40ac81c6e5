"""Live planning on an emulated WAN (issue #8): do the peers' own link probes see the network well
enough for `swarm plan --from-dht` to find as good a plan as one made from the true topology?

Peers (model tiny; what they serve does not matter here) run in the hosts of an emulated network
(benchmarks/netem: namespaces, htb-shaped links, a user-space delay proxy), probe each other and
publish their links. `swarm plan --from-dht` (run inside one host) plans from those measurements
until every pair is measured both ways. Then, on the topology that was asked for:
- the probe's accuracy: measured round trip and bandwidth of every pair against the asked ones;
- the plan's quality: the cost (DT-FM model, true topology) of the plan made from measurements,
  of the plan made from the true topology by the same search, and the mean of random balanced plans.

    flock /tmp/swarm-bench.lock nice -n 5 python benchmarks/live_plan.py [--peers-per-region 2] [--stages 4]
    flock /tmp/swarm-bench.lock nice -n 5 python benchmarks/live_plan.py --peers tokyo=1,oregon=3,virginia=3,london=1

Needs root (namespaces). Writes benchmarks/out/live_plan.json and prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.netem.network import EmulatedNetwork, missing_requirements  # noqa: E402
from benchmarks.netem.topology import load_topology as load_network  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from swarm.local_swarm import LocalSwarm  # noqa: E402
from swarm.planner.cost import evaluate_plan, pair_costs  # noqa: E402
from swarm.planner.search import search_plan  # noqa: E402
from swarm.planner.topology import topology_from_dict  # noqa: E402

# The small model's sizes (swarm/planner/workload.estimated_communication_sizes, 2 stages, 32 samples
# per macro-batch, fp32): activations 4.2 MB per cut, gradients 9.9 MB per stage.
SMALL_C_PP_GB, SMALL_C_DP_GB = 0.004194304, 0.009870336


def _say(text: str) -> None:
    print(text, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default=os.path.join(REPO, "benchmarks", "topologies", "world4.json"))
    parser.add_argument("--peers-per-region", type=int, default=2)
    parser.add_argument(
        "--peers",
        metavar="REGION=N,...",
        help="peers per region, e.g. tokyo=1,oregon=3,virginia=3,london=1 (instead of --peers-per-region)",
    )
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages of the plan")
    parser.add_argument("--c-pp-gb", type=float, default=SMALL_C_PP_GB)
    parser.add_argument("--c-dp-gb", type=float, default=SMALL_C_DP_GB)
    parser.add_argument("--probe-period-s", type=float, default=5.0)
    parser.add_argument("--wait-s", type=float, default=240.0, help="give up waiting for every pair after this")
    parser.add_argument("--time-limit-s", type=float, default=20.0, help="search time limit of each plan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "out", "live_plan.json"))
    return parser.parse_args(argv)


def run_plan(
    net: EmulatedNetwork, host: str, swarm: LocalSwarm, args: argparse.Namespace, workdir: str
) -> tuple[subprocess.CompletedProcess, str, str]:
    plan_path, topology_path = os.path.join(workdir, "plan.json"), os.path.join(workdir, "measured.json")
    command = [
        *net.exec_prefix(host),
        sys.executable,
        "-m",
        "swarm.cli",
        "plan",
        "--from-dht",
        "--initial-peers",
        *swarm.initial_peers,
        "--host-maddrs",
        net.maddr(host),
        "--model",
        "tiny",
        "--stages",
        str(args.stages),
        "--c-pp-gb",
        str(args.c_pp_gb),
        "--c-dp-gb",
        str(args.c_dp_gb),
        "--seed",
        str(args.seed),
        "--time-limit-s",
        str(args.time_limit_s),
        "--out",
        plan_path,
        "--save-topology",
        topology_path,
    ]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    return completed, plan_path, topology_path


def true_topology(network, hosts: list[str], stages: int, c_pp_gb: float, c_dp_gb: float):
    count = len(hosts)
    latency_ms = [[network.host_link(a, b).rtt_ms / 2.0 if a != b else 0.0 for b in hosts] for a in hosts]
    bandwidth = [[network.host_link(a, b).bandwidth_mbit / 1e3 if a != b else 0.0 for b in hosts] for a in hosts]
    return topology_from_dict(
        {
            "name": network.name,
            "stages": stages,
            "replicas": count // stages,
            "c_dp_gb": c_dp_gb,
            "c_pp_gb": c_pp_gb,
            "latency_ms": latency_ms,
            "bandwidth_gbps": bandwidth,
        }
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = missing_requirements()
    if reason:
        print(f"live_plan: {reason}", file=sys.stderr)
        return 2
    base = load_network(args.topology)
    counts = {region: args.peers_per_region for region in base.regions}
    if args.peers:
        counts = {region: int(count) for region, count in (item.split("=") for item in args.peers.split(","))}
    hosts = {f"{region}{i}": region for region, count in counts.items() for i in range(count)}
    network = base.with_hosts(hosts)
    names = list(hosts)
    if len(names) % args.stages:
        print(f"live_plan: {len(names)} peers do not divide into {args.stages} stages", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="live-plan-")
    result: dict = {
        "topology": network.name,
        "hosts": hosts,
        "stages": args.stages,
        "c_pp_gb": args.c_pp_gb,
        "c_dp_gb": args.c_dp_gb,
        "probe_period_s": args.probe_period_s,
        "seed": args.seed,
    }
    started = time.monotonic()
    with (
        EmulatedNetwork(network, workdir=workdir) as net,
        LocalSwarm(
            model="tiny",
            num_stages=2,
            workdir=os.path.join(workdir, "swarm"),
            peer_args=["--link-probe-period-s", str(args.probe_period_s), "--metrics-port", "-1", "--num-threads", "1"],
        ) as swarm,
    ):
        planner_host = names[0]  # the bootstrap node and the planner share the first host
        swarm.start_bootstrap(60.0, "--host-maddrs", net.maddr(planner_host), prefix=net.exec_prefix(planner_host))
        processes = {
            host: swarm.start_peer(
                index % 2, "--host-maddrs", net.maddr(host), name=f"peer-{host}", prefix=net.exec_prefix(host)
            )
            for index, host in enumerate(names)
        }
        swarm.wait_online(list(processes.values()), timeout_s=300.0)
        host_of = {re.search(r"peer (\S+) online", p.log()).group(1): host for host, p in processes.items()}
        online_s = time.monotonic() - started
        _say(f"{len(processes)} peers online after {online_s:.0f} s on {net.describe()}")
        deadline = time.monotonic() + args.wait_s
        while True:
            completed, plan_path, topology_path = run_plan(net, planner_host, swarm, args, workdir)
            line = next((ln for ln in completed.stdout.splitlines() if ln.startswith("topology:")), completed.stderr)
            _say(f"  {time.monotonic() - started:5.0f} s: {line.strip()[:160]}")
            if completed.returncode == 0 and "(0 one way only), 0 estimated" in completed.stdout:
                break
            if time.monotonic() > deadline:
                _say("  not every pair was measured both ways in time; planning with what there is")
                break
            time.sleep(args.probe_period_s)
        if completed.returncode != 0:
            print(f"live_plan: swarm plan failed: {completed.stderr.strip()}", file=sys.stderr)
            return 1
        result["measured_after_s"] = time.monotonic() - started - online_s
    plan = json.load(open(plan_path))
    measured = json.load(open(topology_path))
    peers = [host_of[p] for p in plan["peers"]]  # device order of the plan
    truth = true_topology(network, peers, args.stages, args.c_pp_gb, args.c_dp_gb)

    # Probe accuracy, per unordered pair (the measured topology is symmetrised: mean of both directions).
    pairs = []
    for i in range(len(peers)):
        for j in range(i + 1, len(peers)):
            asked = network.host_link(peers[i], peers[j])
            pairs.append(
                {
                    "hosts": [peers[i], peers[j]],
                    "asked_rtt_ms": asked.rtt_ms,
                    "measured_rtt_ms": 2 * measured["latency_ms"][i][j],
                    "asked_mbit": asked.bandwidth_mbit,
                    "measured_mbit": measured["bandwidth_gbps"][i][j] * 1e3,
                }
            )
    rtt_error = [p["measured_rtt_ms"] - p["asked_rtt_ms"] for p in pairs]
    rate_ratio = [p["measured_mbit"] / p["asked_mbit"] for p in pairs]
    result["pairs"] = pairs
    result["rtt_error_ms"] = {"median": float(np.median(rtt_error)), "min": min(rtt_error), "max": max(rtt_error)}
    result["bandwidth_measured_over_asked"] = {
        "median": float(np.median(rate_ratio)),
        "min": min(rate_ratio),
        "max": max(rate_ratio),
    }

    # Plan quality on the true topology.
    costs = pair_costs(truth)
    live_cost = evaluate_plan(costs, np.array(plan["groups"])).total_s
    best = search_plan(truth, seed=args.seed, time_limit_s=args.time_limit_s)
    rng = np.random.default_rng(args.seed)
    random_costs = [
        evaluate_plan(costs, rng.permutation(len(peers)).reshape(args.stages, -1)).total_s for _ in range(200)
    ]
    result["plan_from_measurements"] = {
        "stage_hosts": [[peers[d] for d in g] for g in plan["groups"]],
        "cost_on_measured_s": plan["cost"]["total_s"],
        "cost_on_true_s": live_cost,
    }
    result["plan_from_true_topology"] = {
        "stage_hosts": [[peers[d] for d in g] for g in best.groups.tolist()],
        "cost_on_true_s": best.cost.total_s,
    }
    result["random_plans_cost_on_true_s"] = {
        "mean": float(np.mean(random_costs)),
        "min": min(random_costs),
        "max": max(random_costs),
        "count": len(random_costs),
    }

    _say(f"\nprobe accuracy over {len(pairs)} host pairs (asked: {args.topology}):")
    _say(
        f"  round trip, measured - asked: median {result['rtt_error_ms']['median']:+.1f} ms "
        f"(min {result['rtt_error_ms']['min']:+.1f}, max {result['rtt_error_ms']['max']:+.1f})"
    )
    _say(
        f"  bandwidth, measured / asked: median {result['bandwidth_measured_over_asked']['median']:.2f} "
        f"(min {result['bandwidth_measured_over_asked']['min']:.2f}, "
        f"max {result['bandwidth_measured_over_asked']['max']:.2f})"
    )
    _say(f"plan cost on the true topology ({args.stages} stages x {len(peers) // args.stages} replicas):")
    _say(f"  from measured links: {live_cost:.3f} s   {result['plan_from_measurements']['stage_hosts']}")
    _say(f"  from true topology:  {best.cost.total_s:.3f} s   {result['plan_from_true_topology']['stage_hosts']}")
    _say(
        f"  random plans:        mean {np.mean(random_costs):.3f} s (min {min(random_costs):.3f}, "
        f"max {max(random_costs):.3f}, {len(random_costs)} plans)"
    )
    write_report(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
