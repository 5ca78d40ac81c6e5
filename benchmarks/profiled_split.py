"""Issue 13 benchmark: a profiled split against the equal split on loopback, and the OP-Fence-style
placement against the planner's search on the five DT-FM scenarios. Writes JSON to
benchmarks/out/ and the tables of benchmarks/RESULTS_profile.md (text below a `<!-- notes -->`
line in that file is kept).

    nice -n 10 .venv/bin/python benchmarks/profiled_split.py [--part all|split|planner] [--steps 12]

Split part: the model is profiled in this process (`models.profile`); for each scenario (stage
speeds: a slower device is emulated with the peers' `--faults slowdown`, which sleeps the extra
time, so it costs no CPU) the balanced split and the equal split are each run as a real loopback
swarm (one peer per stage, one torch thread each). Reported per split: the slowest stage's
compute time per microbatch, measured in-process on the same stage runtimes the peers use
(slowdown included), and the swarm's tokens/s over the timed steps.

Planner part: `search_plan` (iterated local search, the repository's search) and `opfence_plan`
on each scenario, with the scenarios' constant sizes and with c_pp/c_dp taken from a profile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report_file import write_report  # noqa: E402
from models.balanced_split import balanced_split, stage_times  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.layer_costs import split_costs  # noqa: E402
from models.profile import profile_model  # noqa: E402
from models.stages import equal_boundaries  # noqa: E402
from peers.compute.faults import FaultSettings, FaultyStageRuntime  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime  # noqa: E402
from swarm.local_swarm import LocalSwarm, fault_args  # noqa: E402
from swarm.planner.opfence import opfence_plan  # noqa: E402
from swarm.planner.search import search_plan  # noqa: E402
from swarm.planner.topology import load_topology  # noqa: E402
from swarm.planner.workload import communication_sizes, with_communication_sizes  # noqa: E402

SCENARIOS = REPO / "benchmarks" / "dtfm_scenarios"
RESULTS = REPO / "benchmarks" / "RESULTS_profile.md"
NOTES_MARKER = "<!-- notes -->"
# (label, stage speeds relative to this machine's core)
SPLIT_SCENARIOS = [
    ("2 stages, stage 1 on a device 2x slower", [1.0, 0.5]),
    ("3 stages, stage 1 on a device 2x slower", [1.0, 0.5, 1.0]),
    ("2 stages, equal devices", [1.0, 1.0]),
]


# --- split part ------------------------------------------------------------------------------------


def measured_stage_times(
    model: str, boundaries: tuple[int, ...], speeds: list[float], microbatch_size: int, repeats: int
) -> list[float]:
    """Median seconds per microbatch (forward + backward, as a peer serves it) of each stage."""
    config = get_model_config(model)
    num_stages = len(boundaries) - 1
    times = []
    for stage in range(num_stages):
        runtime = StageRuntime(
            config, stage, num_stages, boundaries=boundaries, optimizer=OptimizerSettings(target_batch_size=1 << 30)
        )
        served = (
            runtime
            if speeds[stage] == 1.0
            else FaultyStageRuntime(runtime, FaultSettings(fault_slowdown=1 / speeds[stage]))
        )
        shape, dtype = runtime.module.expected_input(microbatch_size)
        inputs = torch.randint(0, config.vocab_size, shape) if dtype == torch.int64 else torch.randn(shape)
        targets = torch.randint(0, config.vocab_size, (microbatch_size, config.seq_len))
        samples = []
        for repeat in range(repeats + 1):
            started = time.perf_counter()
            if runtime.is_last:
                served.backward(f"m{repeat}", inputs, targets=targets)
            else:
                out = served.forward(f"m{repeat}", inputs)
                served.backward(f"m{repeat}", inputs, grad_outputs=torch.randn_like(out))
            if repeat:  # the first is a warm-up
                samples.append(time.perf_counter() - started)
        times.append(statistics.median(samples))
    return times


def swarm_tokens_per_s(
    model: str,
    boundaries: tuple[int, ...],
    speeds: list[float],
    steps: int,
    warmup: int,
    batch_size: int,
    microbatch_size: int,
) -> dict:
    num_stages = len(boundaries) - 1
    workdir = tempfile.mkdtemp(prefix="swarm-split-bench-")
    report_path = os.path.join(workdir, "report.json")
    flag = ",".join(map(str, boundaries))
    with LocalSwarm(
        model=model,
        num_stages=num_stages,
        workdir=workdir,
        peer_args=["--target-batch-size", str(batch_size), "--num-threads", "1"],
    ) as swarm:
        swarm.start_bootstrap()
        peers = []
        for stage in range(num_stages):
            extra = ["--split-boundaries", flag]
            if speeds[stage] != 1.0:
                extra += fault_args(slowdown=1 / speeds[stage])
            peers.append(swarm.start_peer(stage, *extra))
            swarm.wait_online(peers[-1:])  # the first peer states the split, the others match it
        trainer = swarm.start_trainer(
            "--steps",
            str(warmup + steps),
            "--batch-size",
            str(batch_size),
            "--microbatch-size",
            str(microbatch_size),
            "--num-stages",
            str(num_stages),
            "--report",
            report_path,
        )
        if trainer.popen.wait(timeout=1800) != 0:
            raise RuntimeError(f"trainer failed:\n{trainer.log()[-3000:]}")
    with open(report_path) as f:
        report = json.load(f)
    assert report["split_boundaries"] == list(boundaries), report["split_boundaries"]
    seq_len = get_model_config(model).seq_len
    timed = report["tokens_per_s_by_step"][warmup:]
    seconds = sum(batch_size * seq_len / t for t in timed)
    return {
        "tokens_per_s": len(timed) * batch_size * seq_len / seconds,
        "final_loss": report["final_loss"],
        "microbatches_lost": report["microbatches_lost"],
    }


def split_part(args) -> dict:
    torch.set_num_threads(1)
    profile = profile_model(get_model_config(args.model), batch_size=args.microbatch_size, repeats=args.profile_repeats)
    print(
        f"profiled {args.model}: "
        + ", ".join(f"{layer.name} {layer.compute_s * 1e3:.1f} ms" for layer in profile.layers),
        flush=True,
    )
    costs = split_costs(profile)
    rows = []
    for label, speeds in SPLIT_SCENARIOS:
        num_stages = len(speeds)
        profiled = balanced_split(costs, num_stages, speeds).boundaries
        equal = equal_boundaries(profile.n_layers, num_stages)
        for name, boundaries in (("equal", equal), ("profiled", profiled)):
            row = {
                "scenario": label,
                "speeds": speeds,
                "split": name,
                "boundaries": list(boundaries),
                "predicted_stage_ms": [t * 1e3 for t in stage_times(costs, boundaries, speeds)],
            }
            if name == "profiled" and profiled == equal:
                row["same_as_equal"] = True
                rows.append(row)
                print(f"{label}: the profiled split is the equal split {list(equal)}; not run twice", flush=True)
                continue
            measured = [
                measured_stage_times(args.model, boundaries, speeds, args.microbatch_size, args.stage_repeats)
                for _ in range(args.repetitions)
            ]
            runs = [
                swarm_tokens_per_s(
                    args.model, boundaries, speeds, args.steps, args.warmup, args.batch_size, args.microbatch_size
                )
                for _ in range(args.repetitions)
            ]
            row["measured_stage_ms"] = [[t * 1e3 for t in times] for times in measured]
            row["slowest_stage_ms"] = [max(times) * 1e3 for times in measured]
            row["tokens_per_s"] = [run["tokens_per_s"] for run in runs]
            row["final_loss"] = [run["final_loss"] for run in runs]
            row["microbatches_lost"] = sum(run["microbatches_lost"] for run in runs)
            rows.append(row)
            print(
                f"{label}: {name} {list(boundaries)} slowest stage {row['slowest_stage_ms']} ms, "
                f"{[round(t) for t in row['tokens_per_s']]} tokens/s",
                flush=True,
            )
    return {"profile": profile.to_dict(), "rows": rows}


# --- planner part ----------------------------------------------------------------------------------


def planner_part(args) -> dict:
    torch.set_num_threads(1)
    sized_profile = profile_model(get_model_config(args.planner_model), batch_size=1, repeats=2, warmup=1)
    rows = []
    for case in [f"case{i}" for i in range(1, 6)]:
        constant = load_topology(SCENARIOS / f"{case}.json")
        boundaries = balanced_split(split_costs(sized_profile), constant.stages).boundaries
        sizes = communication_sizes(sized_profile, boundaries, samples_per_macro_batch=args.macro_batch_samples)
        profiled = with_communication_sizes(constant, sizes)
        for sizing, topology in (("constants", constant), ("profile", profiled)):
            started = time.perf_counter()
            search = search_plan(topology, seed=0, time_limit_s=args.search_time_limit_s)
            search_s = time.perf_counter() - started
            opfence = {p: opfence_plan(topology, placement=p) for p in ("stages", "pipelines", "best")}
            rows.append(
                {
                    "scenario": case,
                    "sizes": sizing,
                    "c_pp_gb": topology.c_pp_gb,
                    "c_dp_gb": topology.c_dp_gb,
                    "boundaries": list(boundaries) if sizing == "profile" else None,
                    "search_total_s": search.cost.total_s,
                    "search_runtime_s": search_s,
                    "search_stopped_by_time": search.stopped_by_time,
                    **{f"opfence_{p}_total_s": r.cost.total_s for p, r in opfence.items()},
                    **{f"opfence_{p}_runtime_s": r.elapsed_s for p, r in opfence.items()},
                    "opfence_best_placement": opfence["best"].placement,
                }
            )
            row = rows[-1]
            print(
                f"{case} ({sizing}): search {row['search_total_s']:.3f} s in {search_s:.1f} s; opfence "
                f"{row['opfence_best_total_s']:.3f} s ({row['opfence_best_placement']}) in "
                f"{row['opfence_best_runtime_s'] * 1e3:.0f} ms",
                flush=True,
            )
    return {
        "planner_model": args.planner_model,
        "macro_batch_samples": args.macro_batch_samples,
        "profile_layers": [layer.name for layer in sized_profile.layers],
        "rows": rows,
    }


# --- the results fragment --------------------------------------------------------------------------


def _split_table(split: dict) -> list[str]:
    lines = [
        "| scenario | split | boundaries | predicted stage ms | measured stage ms (1st run) "
        "| slowest stage ms (measured) | tokens/s (swarm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in split["rows"]:
        predicted = ", ".join(f"{t:.0f}" for t in row["predicted_stage_ms"])
        if row.get("same_as_equal"):
            stages = measured = tokens = "same split as equal"
        else:
            stages = ", ".join(f"{t:.0f}" for t in row["measured_stage_ms"][0])
            measured = " / ".join(f"{t:.0f}" for t in row["slowest_stage_ms"])
            tokens = " / ".join(f"{t:,.0f}" for t in row["tokens_per_s"])
        lines.append(
            f"| {row['scenario']} | {row['split']} | {','.join(map(str, row['boundaries']))} "
            f"| {predicted} | {stages} | {measured} | {tokens} |"
        )
    return lines


def _planner_table(planner: dict, sizing: str) -> list[str]:
    lines = [
        "| scenario | c_pp GB | c_dp GB | search cost (s) | search time (s) | OP-Fence best (s) | placement "
        "| OP-Fence stages-in-clusters (s) | OP-Fence time (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in planner["rows"]:
        if row["sizes"] != sizing:
            continue
        lines.append(
            f"| {row['scenario']} | {row['c_pp_gb']:.4g} | {row['c_dp_gb']:.4g} | {row['search_total_s']:.3f} "
            f"| {row['search_runtime_s']:.1f} | {row['opfence_best_total_s']:.3f} "
            f"| {row['opfence_best_placement']} | {row['opfence_stages_total_s']:.3f} "
            f"| {row['opfence_best_runtime_s'] * 1e3:.0f} |"
        )
    return lines


def write_results(result: dict, command: str) -> None:
    lines = [
        "## Profiled splits and OP-Fence placement (issue 13)",
        "",
        f"Command (repository root, {result['cpus']} CPU cores shared with other work, torch "
        f"{result['torch']}, Python {result['python']}; load average {result['load_before']:.1f} when it "
        f"started, {result['load_after']:.1f} when it ended):",
        "",
        "```",
        command,
        "```",
        "",
    ]
    if "split" in result:
        args = result["args"]
        lines += [
            "### Profiled split against the equal split, loopback swarm",
            "",
            f"Model `{args['model']}`, one peer per stage (1 torch thread each), batch {args['batch_size']} "
            f"in microbatches of {args['microbatch_size']}, {args['steps']} timed steps after {args['warmup']} "
            f"warm-up steps, {args['repetitions']} run(s) per split (values separated by /). A slower device is "
            "emulated by `--faults slowdown` on that stage's peer. 'Predicted' = the profile's stage times; "
            "'measured' = forward + backward of one microbatch on each stage's runtime in this process "
            "(median of "
            f"{args['stage_repeats']}), slowdown included.",
            "",
        ]
        lines += _split_table(result["split"]) + [""]
    if "planner" in result:
        planner = result["planner"]
        lines += [
            "### OP-Fence-style placement against the search, the five DT-FM scenarios",
            "",
            "Costs under the DT-FM model (DATAP + PIPELINEP, seconds). 'search' is `swarm/planner/search.py` "
            "(iterated local search, seed 0, its default stop after 30 rounds without improvement, "
            f"time limit {result['args']['search_time_limit_s']:.0f} s); 'OP-Fence best' keeps the cheaper of "
            "whole stages or whole pipelines in bandwidth clusters; 'stages-in-clusters' is the issue's "
            "wording alone.",
            "",
            "With the scenarios' constant sizes (GPT3-XL, as in the paper):",
            "",
        ]
        lines += _planner_table(planner, "constants") + [""]
        lines += [
            f"With c_pp and c_dp from a profile of `{planner['planner_model']}` (balanced 8-stage split, "
            f"{planner['macro_batch_samples']} samples per macro-batch, fp32 on the wire):",
            "",
        ]
        lines += _planner_table(planner, "profile") + [""]
    notes = ""
    if RESULTS.exists() and NOTES_MARKER in RESULTS.read_text():
        notes = RESULTS.read_text().split(NOTES_MARKER, 1)[1]
    RESULTS.write_text("\n".join(lines) + "\n" + NOTES_MARKER + notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "split", "planner"], default="all")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per swarm run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--repetitions", type=int, default=2, help="swarm runs per split")
    parser.add_argument("--profile-repeats", type=int, default=7)
    parser.add_argument("--stage-repeats", type=int, default=7)
    parser.add_argument("--planner-model", default="gpt2-124m-bytes")
    parser.add_argument("--macro-batch-samples", type=int, default=64)
    parser.add_argument("--search-time-limit-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "profiled_split.json")
    args = parser.parse_args()

    result = {
        "args": vars(args) | {"out": str(args.out)},
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_before": os.getloadavg()[0],
    }
    if args.part in ("all", "split"):
        result["split"] = split_part(args)
    if args.part in ("all", "planner"):
        result["planner"] = planner_part(args)
    result["load_after"] = os.getloadavg()[0]
    write_report(args.out, result, indent=1)
    command = "nice -n 10 .venv/bin/python benchmarks/profiled_split.py " + " ".join(sys.argv[1:])
    write_results(result, command.strip())
    print(f"wrote {args.out} and {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
