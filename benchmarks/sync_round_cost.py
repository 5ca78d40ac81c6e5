"""Where a sync round's time goes (issue #22): hivemind's matchmaking against the all-reduce itself,
for two replicas of one stage on loopback, without a trainer.

    .venv/bin/python benchmarks/sync_round_cost.py --model tiny --rounds 10 --out benchmarks/out/sync_round_cost.json

Two `GradientSync` averagers (each with its own DHT node, as two peers) of stage 0 of 2 (with
`--averaging periodic`, two `ParameterAveraging` by steps, whose all-reduce includes copying the
parameters into the averager's buffer and back) start a round together
(`begin_round(..., wait_for_trigger=True)`, as a commit does, but held before the all-reduce); the
time until both have a group is matchmaking, the time from the trigger until both have the averaged
tensors is the all-reduce. The CPU time of this process and all its children
(the DHT nodes, their p2pd daemons and the averagers' processes) is summed over each phase: on a
machine whose cores the training already fills, that, not the wall time, is what a round takes
from the compute; the all-reduce's CPU is also split by process (the p2pd daemons, the averagers'
processes, the rest). The machine's load is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import hivemind
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from peers.compute.stage_runtime import StageRuntime  # noqa: E402
from peers.replicas.averaging import COMPRESSIONS, GradientSync, ParameterAveraging  # noqa: E402
from peers.replicas.averaging_members import named_group_id  # noqa: E402
from peers.replicas.averaging_schedule import AveragingSchedule  # noqa: E402


def cpu_by_kind(averager_pids: set[int]) -> dict[str, float]:
    """CPU seconds so far, split by who spent them: the p2pd daemons (libp2p: streams, encryption,
    the muxer), the averagers' processes (serializing, reducing, hivemind's asyncio), and the rest
    (this process and the DHT nodes)."""
    split = {"p2pd": 0.0, "averagers": 0.0, "rest": 0.0}
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = process.cpu_times()
            kind = "p2pd" if process.name() == "p2pd" else "averagers" if process.pid in averager_pids else "rest"
            split[kind] += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return split


def one_round(
    replicas: list[GradientSync | ParameterAveraging], pool: ThreadPoolExecutor, named: str | None = None
) -> tuple[float, float, float, float, dict[str, float]]:
    """Wall seconds of matchmaking and of the all-reduce, the CPU seconds of each, and the
    all-reduce's CPU seconds by process kind (`cpu_by_kind`). `named`: a step id, to form the group
    a commit of that step would name instead of matchmaking."""
    averager_pids = {r.averager.pid for r in replicas}
    group = None
    if named is not None:
        weights = {r.averager.peer_id.to_base58(): 1.0 for r in replicas}
        group = (named_group_id(named, weights), weights)
    start, cpu_start = time.perf_counter(), sum(cpu_by_kind(averager_pids).values())
    controls = [r.begin_round(len(replicas), weight=1.0, wait_for_trigger=True, named=group) for r in replicas]
    while not all(ParameterAveraging.group_ready(c) for c in controls):
        time.sleep(0.002)
    matched, split_matched = time.perf_counter(), cpu_by_kind(averager_pids)
    results = list(pool.map(lambda rc: finish(*rc), zip(replicas, controls)))
    done, split_done = time.perf_counter(), cpu_by_kind(averager_pids)
    if any(r is None for r in results):
        raise RuntimeError("a round failed")
    cpu_matched, cpu_done = sum(split_matched.values()), sum(split_done.values())
    split = {who: split_done[who] - split_matched[who] for who in split_done}
    return matched - start, done - matched, cpu_matched - cpu_start, cpu_done - cpu_matched, split


def finish(replica: GradientSync | ParameterAveraging, control) -> object:
    """The all-reduce of a begun round, as each mode runs it: sync averages its gradient buffer;
    periodic copies the parameters in, averages and writes them back (`average`)."""
    if isinstance(replica, ParameterAveraging):
        return replica.average(control).averaged or None
    return replica.finish_round(control)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--matchmaking-s", type=float, default=0.5, help="min_matchmaking_time (GradientSync's default)"
    )
    parser.add_argument(
        "--groups",
        choices=("matchmaking", "trainer", "both"),
        default="both",
        help="how each round's group forms: hivemind's matchmaking, or named as a trainer's commit names it "
        "(`--averaging-groups`); both: the two alternating",
    )
    parser.add_argument(
        "--compression", choices=tuple(COMPRESSIONS), default="none", help="the rounds' --averaging-compression"
    )
    parser.add_argument(
        "--averaging",
        choices=("sync", "periodic"),
        default="sync",
        help="what a round averages: sync, the gradients; periodic, the parameters (by steps)",
    )
    parser.add_argument("--out", default="benchmarks/out/sync_round_cost.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    config = get_model_config(args.model)
    first = hivemind.DHT(start=True)
    dhts = [first, hivemind.DHT(start=True, initial_peers=[str(a) for a in first.get_visible_maddrs()])]
    if args.averaging == "sync":
        replicas = [
            GradientSync(
                StageRuntime(config, 0, 2),
                dht,
                args.model,
                matchmaking_s=args.matchmaking_s,
                compression=args.compression,
            )
            for dht in dhts
        ]
    else:
        replicas = [
            ParameterAveraging(
                StageRuntime(config, 0, 2),
                dht,
                args.model,
                schedule=AveragingSchedule(every_steps=1),
                matchmaking_s=args.matchmaking_s,
                compression=args.compression,
            )
            for dht in dhts
        ]
    values = replicas[0].num_values
    try:
        kinds = ["matchmaking", "trainer"] if args.groups == "both" else [args.groups]
        rounds: dict[str, list] = {kind: [] for kind in kinds}
        with ThreadPoolExecutor(len(replicas)) as pool:
            one_round(replicas, pool)  # warm-up: first DHT lookups
            for i in range(args.rounds):
                for kind in kinds:
                    rounds[kind].append(one_round(replicas, pool, named=f"step{i}" if kind == "trainer" else None))
    finally:
        for r in replicas:
            r.shutdown()
        for dht in dhts:
            dht.shutdown()
    summary: dict = {"values": values}
    for kind, measured in rounds.items():
        matchmaking, allreduce = [r[0] for r in measured], [r[1] for r in measured]
        matchmaking_cpu, allreduce_cpu = [r[2] for r in measured], [r[3] for r in measured]
        by_kind = {who: statistics.median(r[4][who] for r in measured) for who in measured[0][4]}
        summary[kind] = {
            "matchmaking_s_median": statistics.median(matchmaking),  # named: forming the group from the commit
            "allreduce_s_median": statistics.median(allreduce),
            "matchmaking_cpu_s_median": statistics.median(matchmaking_cpu),  # both replicas together
            "allreduce_cpu_s_median": statistics.median(allreduce_cpu),
            "allreduce_cpu_s_median_by_process": by_kind,  # p2pd daemons, averagers' processes, the rest
            "matchmaking_s": matchmaking,
            "allreduce_s": allreduce,
            "matchmaking_cpu_s": matchmaking_cpu,
            "allreduce_cpu_s": allreduce_cpu,
        }
        s = summary[kind]
        print(
            f"{args.model} stage 0 of 2 ({values:,} values), 2 replicas, {args.averaging}, {args.rounds} rounds, "
            f"groups by {kind}, "
            f"compression {args.compression}: "
            f"forming the group median {s['matchmaking_s_median']:.3f} s ({s['matchmaking_cpu_s_median']:.3f} CPU s), "
            f"all-reduce median {s['allreduce_s_median']:.3f} s ({s['allreduce_cpu_s_median']:.3f} CPU s; CPU of "
            f"both replicas together: " + ", ".join(f"{who} {cpu:.3f}" for who, cpu in by_kind.items()) + ")",
            flush=True,
        )
    write_report(
        args.out,
        {
            "args": vars(args),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "load_after": os.getloadavg(),
            },
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
