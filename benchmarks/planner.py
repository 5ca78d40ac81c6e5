"""Planner benchmark on the five DT-FM scenarios (issue #8).

For each scenario: the planner's cost and search time next to the Megatron-like layout
(group j = devices 8j..8j+7), random balanced layouts (mean over seeds) and the DT-FM paper's
best known cost (SEEDS.md). Prints a table and writes JSON.

    nice -n 10 python benchmarks/planner.py [--time-limit-s 60] [--seed 0] [--out benchmarks/out/planner.json]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.planner.cost import evaluate_plan, pair_costs  # noqa: E402
from swarm.planner.search import search_plan  # noqa: E402
from swarm.planner.topology import load_topology  # noqa: E402

SCENARIOS = REPO / "benchmarks" / "dtfm_scenarios"
PAPER_BEST_S = {"case1": 3.44, "case2": 49.50, "case3": 16.09, "case4": 34.80, "case5": 49.22}
RANDOM_LAYOUT_SEEDS = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "planner.json")
    args = parser.parse_args(argv)

    rows = []
    for case in sorted(PAPER_BEST_S):
        topology = load_topology(SCENARIOS / f"{case}.json")
        costs = pair_costs(topology)
        stages, replicas = topology.stages, topology.replicas
        megatron = evaluate_plan(costs, np.arange(topology.num_devices).reshape(stages, replicas))
        random_totals = [
            evaluate_plan(
                costs, np.random.default_rng(seed).permutation(topology.num_devices).reshape(stages, replicas)
            ).total_s
            for seed in range(RANDOM_LAYOUT_SEEDS)
        ]
        started = time.perf_counter()
        result = search_plan(topology, seed=args.seed, time_limit_s=args.time_limit_s)
        wall_s = time.perf_counter() - started
        rows.append(
            {
                "scenario": case,
                "planner_total_s": result.cost.total_s,
                "planner_data_parallel_s": result.cost.data_parallel_s,
                "planner_pipeline_s": result.cost.pipeline_s,
                "planner_runtime_s": wall_s,
                "planner_best_found_s": result.best_found_s,
                "planner_rounds": result.rounds,
                "planner_stopped_by_time": result.stopped_by_time,
                "megatron_total_s": megatron.total_s,
                "random_mean_total_s": float(np.mean(random_totals)),
                "paper_best_total_s": PAPER_BEST_S[case],
                "groups": result.groups.tolist(),
            }
        )
        row = rows[-1]
        print(
            f"{case}: planner {row['planner_total_s']:.2f} s in {wall_s:.1f} s "
            f"(best at {result.best_found_s:.1f} s, {result.rounds} rounds)",
            flush=True,
        )

    header = (
        f"| scenario | planner (s) | search time (s) | best found at (s) | Megatron-like (s) "
        f"| random, mean of {RANDOM_LAYOUT_SEEDS} (s) | paper best (s) |"
    )
    print()
    print(header)
    print("|" + "---|" * 7)
    for row in rows:
        print(
            f"| {row['scenario']} | {row['planner_total_s']:.2f} | {row['planner_runtime_s']:.1f} "
            f"| {row['planner_best_found_s']:.1f} | {row['megatron_total_s']:.2f} "
            f"| {row['random_mean_total_s']:.2f} | {row['paper_best_total_s']:.2f} |"
        )
    write_report(
        args.out,
        {
            "seed": args.seed,
            "time_limit_s": args.time_limit_s,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "results": rows,
        },
        indent=1,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
