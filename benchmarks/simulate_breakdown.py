"""Where a simulated swarm loses throughput against the optimum (issue #7's breakdown).

Run from the repository root:
    python -m benchmarks.simulate_breakdown --seed 0 --join-scale 0 --out benchmarks/out/breakdown.json

Replays the ``rebalance`` policy of benchmarks/simulate.py over the same trace and, at every
sample, splits the gap ``optimum - achieved`` (samples/s, summed over samples and reported as
points of the optimum's total) into:

- ``in_transit``: ``optimum - best(online)``, where ``best(online)`` is ``optimal_bottleneck``
  over the peers serving right now: capacity the optimum counts that is downloading a stage
  (moves in flight) or standing by.
- ``imbalance``: ``best(online) - achieved``: how far the serving peers' placement is from the
  best placement of the same peers. It is split by the state of the bottleneck stage (the stage
  with the least *online* throughput; ties: lowest index):
  - ``repair_in_flight``: a peer is ``joining`` that stage (a move or newcomer will land);
  - ``awaiting_check``: no repair in flight, but ``plan_rebalance`` on the *true* current state
    (every live peer's real record, no lingering ghosts) would move a peer: the plan waits for
    its named peers' next randomised check (or for a stale view to catch up);
  - ``no_plan``: ``plan_rebalance`` on the true state moves nobody (hysteresis ``min_gain``, or
    the water-filling plan cannot raise the bottleneck with whole peers).
- ``since_loss``: the imbalance loss binned by how long ago the bottleneck stage last lost a
  serving peer (seen between consecutive samples; resolution ``sample_period_s``).

Decisions are those of peers/placement/rebalance.py, as in benchmarks/simulate.py; nothing here changes
the replay.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

from benchmarks.report_file import write_report  # noqa: E402
from benchmarks.simulate import SimulationConfig, generate_trace, optimum_series, replay  # noqa: E402
from peers.placement.rebalance import ReplicaView, optimal_bottleneck, plan_rebalance  # noqa: E402

SINCE_LOSS_BINS_S = (60.0, 180.0, 300.0, 600.0, math.inf)


def _thinnest_over_others_mean(totals: list[float]) -> float:
    thinnest = min(range(len(totals)), key=lambda s: (totals[s], s))
    others = [t for s, t in enumerate(totals) if s != thinnest]
    return totals[thinnest] / (math.fsum(others) / len(others)) if others and math.fsum(others) > 0 else 1.0


def breakdown(config: SimulationConfig, policy: str = "rebalance") -> dict:
    trace = generate_trace(config)
    optimum, _ = optimum_series(trace, config)
    samples: list[dict] = []
    last_stage: dict[int, int] = {}  # trace index -> stage it served at the previous sample
    lost_at_s = [0.0] * config.stages  # when each stage last lost a serving peer

    def observe(now_s: float, live: dict, view: list[ReplicaView]) -> None:
        for i, stage in last_stage.items():
            peer = live.get(i)
            if peer is None or peer.stage != stage:
                lost_at_s[stage] = now_s
        online = [p for p in live.values() if p.record.state == "online"]
        last_stage.clear()
        last_stage.update({i: p.stage for i, p in live.items() if p.record.state == "online"})
        per_stage = [0.0] * config.stages
        for p in online:
            per_stage[p.stage] += p.life.throughput
        achieved = min(per_stage)
        bottleneck = min(range(config.stages), key=lambda s: (per_stage[s], s))
        joining_it = any(p.stage == bottleneck and p.record.state == "joining" for p in live.values())
        truth = [p.record for p in live.values()]
        landed = [0.0] * config.stages  # once every move and join in flight has landed
        for p in live.values():
            landed[p.stage] += p.life.throughput
        plan = plan_rebalance(truth, config.stages, min_gain=config.min_gain)
        plan_any_gain = plan_rebalance(truth, config.stages, min_gain=0.0)
        samples.append(
            {
                "t_s": now_s,
                "achieved": achieved,
                "best_online": optimal_bottleneck([p.life.throughput for p in online], config.stages),
                # what should_standby_take_over compares with its min_fraction (serving = online + joining)
                "thinnest_over_others_mean": _thinnest_over_others_mean(landed),
                "landed": min(landed),
                "planned": plan.planned_bottleneck,
                "planned_any_gain": plan_any_gain.planned_bottleneck,
                "best_all": optimal_bottleneck([p.life.throughput for p in live.values()], config.stages),
                "repair_in_flight": joining_it,
                "true_plan_moves": len(plan.moves),
                "since_loss_s": now_s - lost_at_s[bottleneck],
                "live": len(live),
                "online": len(online),
            }
        )

    result = replay(trace, config, policy, observe=observe)
    assert len(samples) == len(optimum)
    total = math.fsum(optimum)
    parts = {"in_transit": 0.0, "repair_in_flight": 0.0, "awaiting_check": 0.0, "no_plan": 0.0}
    since = {f"<{b:.0f}s" if math.isfinite(b) else "older": 0.0 for b in SINCE_LOSS_BINS_S}
    for sample, best in zip(samples, optimum):
        parts["in_transit"] += max(best - sample["best_online"], 0.0)
        gap = sample["best_online"] - sample["achieved"]
        if sample["repair_in_flight"]:
            parts["repair_in_flight"] += gap
        elif sample["true_plan_moves"]:
            parts["awaiting_check"] += gap
        else:
            parts["no_plan"] += gap
        for b, key in zip(SINCE_LOSS_BINS_S, since):
            if sample["since_loss_s"] < b:
                since[key] += gap
                break
    achieved = math.fsum(s["achieved"] for s in samples)
    landing = {
        "transfers_landing": 100 * math.fsum(s["landed"] - s["achieved"] for s in samples) / total,
        "placement_once_landed": 100 * math.fsum(s["best_all"] - s["landed"] for s in samples) / total,
        "of_which_plan_not_yet_acted_on": 100 * math.fsum(s["planned"] - s["landed"] for s in samples) / total,
        "of_which_min_gain": 100 * math.fsum(s["planned_any_gain"] - s["planned"] for s in samples) / total,
        "of_which_planner_limit": 100 * math.fsum(s["best_all"] - s["planned_any_gain"] for s in samples) / total,
        "optimum_minus_best_all": 100 * math.fsum(o - s["best_all"] for o, s in zip(optimum, samples)) / total,
    }
    return {
        "config": {k: v for k, v in vars(config).items()},
        "policy": policy,
        "share_of_optimal": achieved / total,
        "lost_points": {k: 100 * v / total for k, v in parts.items()},
        "imbalance_by_time_since_bottleneck_lost_a_peer_points": {k: 100 * v / total for k, v in since.items()},
        "lost_points_by_landing": landing,
        "lowest_thinnest_over_others_mean": min(s["thinnest_over_others_mean"] for s in samples),
        "moves": result["moves"],
        "checks": result["checks"],
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--join-scale", type=float, default=1.0)
    parser.add_argument("--check-on-loss", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--policy", default="rebalance", choices=("static", "rebalance"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/simulate_breakdown.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    config = replace(SimulationConfig(), seed=args.seed, join_scale=args.join_scale, check_on_loss=args.check_on_loss)
    report = breakdown(config, args.policy)
    write_report(args.out, report, indent=1)
    print(
        f"{args.policy}: {report['share_of_optimal']:.2%} of optimal, {report['moves']} moves; "
        f"points lost: " + ", ".join(f"{k} {v:.2f}" for k, v in report["lost_points"].items())
    )
    print("points lost, other split: " + ", ".join(f"{k} {v:.2f}" for k, v in report["lost_points_by_landing"].items()))
    print(
        "imbalance by time since the bottleneck stage lost a peer: "
        + ", ".join(f"{k} {v:.2f}" for k, v in report["imbalance_by_time_since_bottleneck_lost_a_peer_points"].items())
    )
    print(f"lowest (thinnest stage / mean of the others), serving: {report['lowest_thinnest_over_others_mean']:.3f}")
    print(f"{time.perf_counter() - started:.1f} s wall; wrote {args.out}")


if __name__ == "__main__":
    main()
