"""Churn (issue #3): a swarm trains while peers are SIGKILLed and started on a schedule.

    flock /tmp/swarm-bench.lock nice -n 5 .venv/bin/python benchmarks/churn.py --out benchmarks/out/churn.json
    (about 4-5 minutes: 5 phases of --phase-s 45 s, plus start-up and joins; --phase-s 20 for ~2-3 minutes)

2 stages; the schedule, after a warm-up, in phases of --phase-s seconds:

    phase  event at its start                 replicas (stage 0 + stage 1)
    A      -                                  2 + 2
    B      start a stage-0 peer               3 + 2
    C      start a stage-1 peer               3 + 3
    D      SIGKILL a stage-1 peer             3 + 2
    E      SIGKILL a stage-0 peer             2 + 2

Surviving capacity. After each kill the survivors are a set of peers this run has already measured
in steady state with the same number of identical peers per stage: D's 3 + 2 were measured in B,
E's 2 + 2 in A. The capacity of a set is the tokens/s of steps that completed in its reference
phase, after the first --settle-s seconds (the ramp-up of a join). A "start" phase begins when
the new peer is online (it loads the stage's state from a replica first). Every peer runs with
--faults slowdown (default 10): its compute is followed by 9x as much sleep, as on a volunteer
device 10x slower than one core of this machine, so that a peer's capacity is its own and not a
slice of the machine's two cores (otherwise a kill frees CPU for the survivors and looks free).
The default model is `tiny` so that steps are short (a stall shows at sub-second resolution) even
when other work loads the two cores; `--model small` is heavier and slower.

Figures per kill:
- stall_s: the longest time without a completed step from the kill on (within --horizon-s), and
  the reference phase's median time between steps, to compare with. Goal: stall < 2x the request
  timeout. The trainer's TimeoutPolicy never times out a call in under 5 s (its floor), so the goal
  is judged against the strictest reading, 2 x 5 s = 10 s.
- recovery_s: from the kill to the end of the first --window-s window whose tokens/s reach 90% of
  the surviving capacity (conservative: it is never less than the window). Goal: <= 30 s.
- lost / retried microbatches over the run, failures by kind, and traffic share per peer per phase.

Time series: steps are timed by the trainer (its report, written after every step, is polled);
the trainer's clock is aligned to this script's by the smallest observed report delay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402

# --- the schedule ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    name: str
    action: str  # "none", "start" or "kill"
    stage: int | None  # the stage of the peer started or killed
    replicas: tuple[int, int]  # replicas per stage during the phase
    reference: str  # the phase whose steady rate is this peer set's capacity


SCHEDULE = (
    Phase("A", "none", None, (2, 2), "A"),
    Phase("B", "start", 0, (3, 2), "B"),
    Phase("C", "start", 1, (3, 3), "C"),
    Phase("D", "kill", 1, (3, 2), "B"),
    Phase("E", "kill", 0, (2, 2), "A"),
)


# --- pure analysis (tested in tests/unit/test_churn_analysis.py) ---------------------------------------


def rate_between(step_end_s: Sequence[float], tokens_per_step: int, start_s: float, end_s: float) -> float:
    """Tokens/s of the steps that completed in (start_s, end_s]."""
    if end_s <= start_s:
        raise ValueError(f"empty interval ({start_s}, {end_s}]")
    steps = sum(1 for t in step_end_s if start_s < t <= end_s)
    return steps * tokens_per_step / (end_s - start_s)


def rate_series(
    step_end_s: Sequence[float], tokens_per_step: int, start_s: float, end_s: float, bin_s: float = 1.0
) -> list[tuple[float, float]]:
    """(bin start, tokens/s) for consecutive bins of bin_s seconds from start_s to end_s."""
    series, t = [], start_s
    while t + bin_s <= end_s + 1e-9:
        series.append((round(t - start_s, 6), rate_between(step_end_s, tokens_per_step, t, t + bin_s)))
        t += bin_s
    return series


def stall_after(step_end_s: Sequence[float], event_s: float, horizon_s: float) -> float:
    """Longest time without a completed step in [event_s, event_s + horizon_s]: the gap from the
    event (or a completion after it) to the next completion; if none follows within the horizon,
    the time to the horizon's end."""
    times = sorted(t for t in step_end_s if event_s < t <= event_s + horizon_s)
    longest, previous = 0.0, event_s
    for t in times:
        longest = max(longest, t - previous)
        previous = t
    return max(longest, event_s + horizon_s - previous)


def recovery_after(
    step_end_s: Sequence[float],
    tokens_per_step: int,
    event_s: float,
    capacity: float,
    *,
    window_s: float,
    fraction: float = 0.9,
    horizon_s: float,
    hop_s: float = 0.1,
) -> float | None:
    """Seconds from the event to the end of the first window (window_s long, starting at or after
    the event) whose tokens/s reach `fraction` of `capacity`; None if none does within horizon_s."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    start = event_s
    while start + window_s <= event_s + horizon_s + 1e-9:
        if rate_between(step_end_s, tokens_per_step, start, start + window_s) >= fraction * capacity:
            return start + window_s - event_s
        start += hop_s
    return None


def median_gap(step_end_s: Sequence[float], start_s: float, end_s: float) -> float | None:
    times = sorted(t for t in step_end_s if start_s < t <= end_s)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def align_clock(observations: Sequence[tuple[int, float]], step_end_s: Sequence[float]) -> float:
    """Offset to add to the trainer's step times to get this script's time. `observations`: (steps
    seen in the report, time it was seen). A report is seen after it was written, never before, so
    the smallest delay is the best estimate."""
    offsets = [seen_at - step_end_s[steps - 1] for steps, seen_at in observations if 0 < steps <= len(step_end_s)]
    if not offsets:
        raise ValueError("no report observation matches the trainer's steps")
    return min(offsets)


def analyse(
    step_end_s: Sequence[float],
    tokens_per_step: int,
    phase_starts: dict[str, float],
    end_s: float,
    *,
    settle_s: float,
    window_s: float,
    horizon_s: float,
    timeout_floor_s: float = 5.0,
) -> dict:
    """Capacity of every phase, and stall and recovery after every kill (all times in one clock)."""
    names = [p.name for p in SCHEDULE]
    bounds = {
        name: (phase_starts[name], phase_starts[names[i + 1]] if i + 1 < len(names) else end_s)
        for i, name in enumerate(names)
    }
    phases = {}
    for phase in SCHEDULE:
        start, end = bounds[phase.name]
        phases[phase.name] = {
            "replicas": list(phase.replicas),
            "event": phase.action,
            "event_stage": phase.stage,
            "start_s": start,
            "end_s": end,
            "steady_tokens_per_s": rate_between(step_end_s, tokens_per_step, start + settle_s, end),
            "median_step_gap_s": median_gap(step_end_s, start + settle_s, end),
        }
    kills = []
    for phase in SCHEDULE:
        if phase.action != "kill":
            continue
        start, end = bounds[phase.name]
        capacity = phases[phase.reference]["steady_tokens_per_s"]
        stall_s = stall_after(step_end_s, start, horizon_s)
        recovery_s = (
            recovery_after(
                step_end_s, tokens_per_step, start, capacity, window_s=window_s, horizon_s=min(horizon_s, end - start)
            )
            if capacity > 0
            else None
        )
        kills.append(
            {
                "phase": phase.name,
                "stage": phase.stage,
                "at_s": start,
                "surviving_capacity_tokens_per_s": capacity,
                "capacity_measured_in": phase.reference,
                "stall_s": stall_s,
                "normal_step_gap_s": phases[phase.reference]["median_step_gap_s"],
                "recovery_s": recovery_s,
                "goal_stall_met": stall_s < 2 * timeout_floor_s,
                "goal_recovery_met": recovery_s is not None and recovery_s <= 30.0,
            }
        )
    return {"phases": phases, "kills": kills}


# --- running it --------------------------------------------------------------------------------------


def _read_report(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _peer_key(process) -> str | None:
    match = re.search(r"peer (\S+) online", process.log())
    return match.group(1)[-8:] if match else None


def run(args) -> dict:
    from models.config import get_model_config
    from swarm.local_swarm import LocalSwarm, fault_args

    seq_len = get_model_config(args.model).seq_len
    tokens_per_step = args.batch_size * seq_len
    workdir = tempfile.mkdtemp(prefix="swarm-churn-")
    report_path = os.path.join(workdir, "report.json")
    peer_args = [
        "--target-batch-size",
        str(args.batch_size),
        "--num-threads",
        "1",
        "--announce-period-s",
        str(args.announce_period_s),
        *fault_args(slowdown=args.slowdown),
    ]
    observations: list[tuple[int, float]] = []
    calls_at: dict[str, dict] = {}
    phase_starts: dict[str, float] = {}
    names: dict[str, str] = {}
    joins: dict[str, dict] = {}
    with LocalSwarm(model=args.model, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        peers = {0: [swarm.start_peer(0) for _ in range(2)], 1: [swarm.start_peer(1) for _ in range(2)]}
        swarm.wait_online(peers[0] + peers[1])
        trainer = swarm.start_trainer(
            "--steps",
            "1000000",
            "--batch-size",
            str(args.batch_size),
            "--microbatch-size",
            str(args.microbatch_size),
            "--max-in-flight",
            str(args.max_in_flight),
            "--num-stages",
            "2",
            "--refresh-period-s",
            str(args.refresh_period_s),
            "--report",
            report_path,
        )
        clock0 = time.monotonic()

        def poll(until_s: float) -> dict | None:
            """Watch the report until this script's clock reaches until_s; returns the latest one."""
            latest = None
            while time.monotonic() - clock0 < until_s:
                if not trainer.alive:
                    raise RuntimeError(f"the trainer exited:\n{trainer.log()[-3000:]}")
                report = _read_report(report_path)
                if report and report["steps"] and (not observations or report["steps"] > observations[-1][0]):
                    observations.append((report["steps"], time.monotonic() - clock0))
                    latest = report
                time.sleep(0.05)
            return latest

        deadline = time.monotonic() + 300
        while not observations or observations[-1][0] < args.warmup_steps:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {args.warmup_steps} steps within 300 s:\n{trainer.log()[-3000:]}")
            poll(time.monotonic() - clock0 + 0.5)
        t = time.monotonic() - clock0
        for phase in SCHEDULE:
            if phase.action == "start":
                started_at = time.monotonic() - clock0
                process = swarm.start_peer(phase.stage)
                peers[phase.stage].append(process)
                swarm.wait_online([process], timeout_s=300)  # the phase is that of the new set of peers
                joins[process.name] = {"started_s": started_at, "online_s": time.monotonic() - clock0}
            elif phase.action == "kill":
                process = peers[phase.stage].pop()  # the newest peer of the stage
                process.signal(signal.SIGKILL)
                print(f"[{time.monotonic() - clock0:7.1f} s] SIGKILL {process.name}", flush=True)
            phase_starts[phase.name] = time.monotonic() - clock0
            if phase.action == "start":
                print(f"[{phase_starts[phase.name]:7.1f} s] started {process.name}", flush=True)
            t = phase_starts[phase.name] + args.phase_s
            poll(t)
            report = _read_report(report_path)
            calls_at[phase.name] = dict(report["calls_by_peer"]) if report else {}
            print(
                f"[{time.monotonic() - clock0:7.1f} s] phase {phase.name} ({phase.replicas[0]} + "
                f"{phase.replicas[1]}) over, {report['steps'] if report else 0} steps",
                flush=True,
            )
        end_s = time.monotonic() - clock0
        final = _read_report(report_path)
        for process in swarm.peers():
            key = _peer_key(process)
            if key:
                names[key] = process.name
            served = re.search(r"first request served ([\d.]+) s after the online record", process.log())
            if process.name in joins:
                joins[process.name]["first_request_after_online_record_s"] = float(served.group(1)) if served else None
        trainer_alive = trainer.alive
    step_end = [align_clock(observations, final["step_end_s"]) + t for t in final["step_end_s"]]
    analysis = analyse(
        step_end,
        tokens_per_step,
        phase_starts,
        end_s,
        settle_s=args.settle_s,
        window_s=args.window_s,
        horizon_s=args.horizon_s,
    )
    shares, previous = {}, {}
    for phase in SCHEDULE:
        now = calls_at.get(phase.name, {})
        delta = {names.get(k, k): now.get(k, 0) - previous.get(k, 0) for k in now}
        shares[phase.name] = {}
        for stage in (0, 1):  # shares within each stage (stage 0 serves a forward and a backward per microbatch)
            of_stage = {name: calls for name, calls in delta.items() if name.startswith(f"peer-s{stage}-")}
            total = sum(of_stage.values()) or 1
            shares[phase.name].update({name: round(calls / total, 3) for name, calls in sorted(of_stage.items())})
        previous = now
    first = phase_starts[SCHEDULE[0].name]
    return {
        "benchmark": "churn",
        "model": args.model,
        "batch_size": args.batch_size,
        "microbatch_size": args.microbatch_size,
        "max_in_flight": args.max_in_flight,
        "slowdown": args.slowdown,
        "phase_s": args.phase_s,
        "settle_s": args.settle_s,
        "window_s": args.window_s,
        "refresh_period_s": args.refresh_period_s,
        "announce_period_s": args.announce_period_s,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_average_at_end": os.getloadavg(),
        "trainer_alive_at_end": trainer_alive,
        "steps": final["steps"],
        "microbatches_sent": final["microbatches_sent"],
        "microbatches_lost": final["microbatches_lost"],
        "microbatches_retried": final["microbatches_retried"],
        "calls_retried": final["calls_retried"],
        "failures_by_kind": final["failures_by_kind"],
        "calls_share_by_phase": shares,
        "joins": joins,
        **analysis,
        "tokens_per_s_by_second": rate_series(step_end, tokens_per_step, first, end_s, 1.0),
        "tokens_per_s_rolling_5s": [
            (round(t - first, 1), rate_between(step_end, tokens_per_step, t - 5.0, t))
            for t in [first + 5.0 + i for i in range(int(end_s - first - 5.0) + 1)]
        ],
        "step_end_s": [round(t - first, 3) for t in step_end if t > first],
    }


def summary(result: dict) -> str:
    lines = [
        f"churn: {result['model']}, batch {result['batch_size']} ({result['microbatch_size']}/microbatch), "
        f"peers slowed {result['slowdown']}x, phases of {result['phase_s']:.0f} s; "
        f"{result['steps']} steps, {result['microbatches_sent']} microbatches, lost {result['microbatches_lost']}, "
        f"retried {result['microbatches_retried']} ({result['calls_retried']} calls: {result['failures_by_kind']})",
        "phase  replicas  event           tokens/s (steady)  step gap  call shares",
    ]
    for name, phase in result["phases"].items():
        event = phase["event"] if phase["event"] == "none" else f"{phase['event']} stage {phase['event_stage']}"
        gap = phase["median_step_gap_s"]
        shares = ", ".join(f"{k} {v:.2f}" for k, v in result["calls_share_by_phase"].get(name, {}).items())
        lines.append(
            f"{name:<6} {phase['replicas'][0]} + {phase['replicas'][1]}     {event:<15} "
            f"{phase['steady_tokens_per_s']:>10,.0f}        {gap if gap is None else round(gap, 2)!s:>6} s  {shares}"
        )
    for kill in result["kills"]:
        recovery = "never" if kill["recovery_s"] is None else f"{kill['recovery_s']:.1f} s"
        lines.append(
            f"kill in {kill['phase']} (stage {kill['stage']}): stall {kill['stall_s']:.1f} s (normal step gap "
            f"{kill['normal_step_gap_s']:.2f} s; goal < 10 s: {'met' if kill['goal_stall_met'] else 'NOT met'}), "
            f"back to 90% of {kill['surviving_capacity_tokens_per_s']:,.0f} tokens/s (phase "
            f"{kill['capacity_measured_in']}) after {recovery} (goal <= 30 s: "
            f"{'met' if kill['goal_recovery_met'] else 'NOT met'})"
        )
    for name, join in result["joins"].items():
        first = join.get("first_request_after_online_record_s")
        lines.append(
            f"join {name}: online {join['online_s'] - join['started_s']:.1f} s after its start, first request "
            f"{'never' if first is None else f'{first:.2f} s'} after its online record"
        )
    lines.append(
        f"lost microbatches: {result['microbatches_lost']} (goal 0: "
        f"{'met' if result['microbatches_lost'] == 0 and result['trainer_alive_at_end'] else 'NOT met'})"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--max-in-flight", type=int, default=8)
    parser.add_argument("--slowdown", type=float, default=10.0, help="every peer's --faults slowdown")
    parser.add_argument("--phase-s", type=float, default=45.0, help="seconds per phase (5 phases + warm-up)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument(
        "--settle-s", type=float, default=10.0, help="seconds after a phase starts that its steady rate leaves out"
    )
    parser.add_argument("--window-s", type=float, default=5.0, help="window of the recovery rate")
    parser.add_argument(
        "--horizon-s",
        type=float,
        default=40.0,
        help="how long after a kill stall and recovery are looked for (at most the phase)",
    )
    parser.add_argument("--refresh-period-s", type=float, default=3.0, help="the trainer's (its default)")
    parser.add_argument(
        "--announce-period-s", type=float, default=5.0, help="the peers' (their default; record TTL 3x)"
    )
    parser.add_argument("--out", default="benchmarks/out/churn.json")
    args = parser.parse_args()
    from swarm.local_swarm import LocalSwarmError

    try:
        result = run(args)
    except (LocalSwarmError, RuntimeError) as e:  # a process that failed; its log tail is in the message
        first_line, _, details = str(e).partition("\n")
        print(details[-2000:], file=sys.stderr)
        print(f"churn: error: {first_line}", file=sys.stderr)
        return 1
    print(summary(result))
    write_report(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
