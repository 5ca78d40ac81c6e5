"""What agreement between replicas costs (issue #22): 2 stages x 2 replicas of `small` trained
without averaging, with exact sync averaging, and with sync averaging one step late, in one run,
against one replica per stage at equal samples.

    .venv/bin/python benchmarks/replica_speed.py --out benchmarks/out/replica_speed.json

Runs, one after the other, each a real loopback swarm (`LocalSwarm`, through `run` of
benchmarks/replicas.py: same data, same order, exit checkpoints evaluated on held-out windows):
* `1 replica`: one peer per stage, the loss reference (as one process, up to the order in which a
  peer sums a step's microbatch gradients);
* `2x2 none`: two peers per stage, no averaging, each stepping on its half of every batch: the
  throughput reference (replicas drift apart, so its loss is not the point);
* `2x2 sync exact`: `--averaging sync --sync-delay 0`, every commit waits for the all-reduce and step;
* `2x2 sync delayed`: `--averaging sync --sync-delay 1`, the commit answers at once and the update is
  applied at the next one (peers/replicas/delayed_sync.py), each step computing where the peers'
  default weight prediction puts it (`local-step` since session 15, `last-update` before), the
  steps of the learning-rate warmup exact (`--sync-delay-from`'s default since session 28);
* `2x2 sync delayed from step 0`: the same with the delay from the first step (`--sync-delay-from 0`);
* `2x2 sync delayed local-step`, `... last-update`, `... unpredicted`: the same with
  `--weight-prediction local-step` (on the parameters plus the update the replica's own gradients
  of the step in flight make), `last-update` (plus the last update applied) or `none`;
* `2x2 sync exact clipped`: exact sync with the trainer's `--clip-grad-norm 1.0`, whose commit has
  two phases (the replicas average and answer their gradient's norm, then step on the scale);
* `... matchmaking`, `... trainer groups`: the same with each round's group formed by hivemind's
  matchmaking or named by the trainer's commit (`--averaging-groups`; the peers' default is
  `trainer` since session 16, `matchmaking` before);
* `... fp16`: the same with the all-reduce's parts sent as fp16 (`--averaging-compression fp16`),
  half the bytes of a round, the replicas then agreeing only to fp16's rounding;
* `2x2 outer int4/10 overlapped` and `... background`: outer rounds every 10 steps in int4,
  overlapped, the trainer's commits waited for or in the background (`--outer-commits`, whose
  default is background).
With `--repeats N` the 2x2 runs are repeated N times, alternating, so that a change in the
machine's load hits each.

tokens/s: the trainer's step times (its steps only: no start-up, no final flush), as in
benchmarks/replicas.py; `report_tokens_per_s` is the trainer report's (the whole training loop,
the flush included). CPU seconds a step by kind of process (peers, their averager and DHT
processes, the p2pd daemons, the trainer; benchmarks/process_cpu.py) show where a layout's time
goes on a machine the swarm fills. The machine's load (1/5/15 min, `os.getloadavg`) is recorded
before and after: on a shared machine the figures are only as steady as that load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.process_cpu import KINDS  # noqa: E402
from benchmarks.replicas import run  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from swarm.demo import lr_schedule_args  # noqa: E402

OUTER_INT4_10 = ("--averaging-every-steps", "10", "--outer-codec", "int4", "--outer-overlap")
LAYOUTS = {  # name: (replicas per stage, averaging, peer args, trainer args)
    "2x2 none": (2, "none", (), ()),
    "2x2 sync exact": (2, "sync", ("--sync-delay", "0"), ()),
    "2x2 sync delayed": (2, "sync", ("--sync-delay", "1"), ()),  # with the default weight prediction
    # the delay from the first step, where the default begins it after the learning-rate warmup
    "2x2 sync delayed from step 0": (2, "sync", ("--sync-delay", "1", "--sync-delay-from", "0"), ()),
    "2x2 sync delayed last-update": (2, "sync", ("--sync-delay", "1", "--weight-prediction", "last-update"), ()),
    "2x2 sync delayed unpredicted": (2, "sync", ("--sync-delay", "1", "--weight-prediction", "none"), ()),
    "2x2 sync delayed local-step": (2, "sync", ("--sync-delay", "1", "--weight-prediction", "local-step"), ()),
    "2x2 sync exact clipped": (2, "sync", ("--sync-delay", "0"), ("--clip-grad-norm", "1.0")),
    # the rounds' groups named by the trainer's commit (the peers' default) or by hivemind's matchmaking
    "2x2 sync exact matchmaking": (2, "sync", ("--sync-delay", "0", "--averaging-groups", "matchmaking"), ()),
    "2x2 sync delayed matchmaking": (2, "sync", ("--sync-delay", "1", "--averaging-groups", "matchmaking"), ()),
    "2x2 sync exact trainer groups": (2, "sync", ("--sync-delay", "0", "--averaging-groups", "trainer"), ()),
    "2x2 sync delayed trainer groups": (2, "sync", ("--sync-delay", "1", "--averaging-groups", "trainer"), ()),
    # the all-reduce's parts sent as fp16 (`--averaging-compression fp16`): half the bytes of a round
    "2x2 sync exact fp16": (2, "sync", ("--sync-delay", "0", "--averaging-compression", "fp16"), ()),
    "2x2 sync delayed fp16": (2, "sync", ("--sync-delay", "1", "--averaging-compression", "fp16"), ()),
    # exact sync's all-reduce over hivemind's averager or over gloo (`--averaging-transport`; gloo's
    # row runs without a run authority, which gloo refuses; every other row has one, as a local swarm)
    "2x2 sync exact hivemind": (2, "sync", ("--sync-delay", "0", "--averaging-transport", "hivemind"), ()),
    "2x2 sync exact gloo": (2, "sync", ("--sync-delay", "0", "--averaging-transport", "gloo"), ()),
    # ... by exchange: each replica fetches the other's gradient over the data plane (peers/replicas/
    # sync_exchange.py; auto's choice in a run with an authority, where gloo may not be used)
    "2x2 sync exact exchange": (2, "sync", ("--sync-delay", "0", "--averaging-transport", "exchange"), ()),
    # the peers' default `--averaging`, whatever it is (auto since issue #56: sync, by exchange in a run
    # with an authority)
    "2x2 default": (2, None, (), ()),
    # outer rounds (issue #56): every 5 steps, int8 pseudo-gradients, waited for or overlapped
    "2x2 outer int8": (2, "outer", ("--averaging-every-steps", "5", "--outer-codec", "int8"), ()),
    "2x2 outer int8 overlapped": (
        2,
        "outer",
        ("--averaging-every-steps", "5", "--outer-codec", "int8", "--outer-overlap"),
        (),
    ),
    # ... int4 every 10 steps overlapped (`--averaging auto`'s choice on a home link with a 6% budget),
    # with each step waiting for the commit, or the next step starting while it travels
    "2x2 outer int4/10 overlapped": (2, "outer", OUTER_INT4_10, ("--outer-commits", "wait")),
    "2x2 outer int4/10 overlapped background": (2, "outer", OUTER_INT4_10, ("--outer-commits", "background")),
}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


SAME_RUN = ("model", "stages", "steps", "batch_size", "microbatch_size", "lr", "schedule", "eval_samples")


def earlier_reference(path: str, args) -> dict:
    """The 1-replica run of an earlier output, if it trained what this invocation trains."""
    with open(path) as f:
        earlier = json.load(f)
    different = [k for k in SAME_RUN if earlier["args"].get(k) != getattr(args, k)]
    if different:
        raise SystemExit(f"--reference-from {path}: a different run ({', '.join(different)} differ)")
    print(f"--- 1 replica: from {path}", flush=True)
    return earlier["reference"]


def picked(name: str, words: list[str]) -> bool:
    """Whether `--only words` picks the layout `name`: a word that is a layout's full name picks that
    layout alone; any other word picks every layout whose name contains it."""
    return any(w == name or (w not in LAYOUTS and w in name) for w in words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--schedule",
        choices=("constant", "demo"),
        default="constant",
        help="the peers' learning rate: constant --lr, or the demo's (warmup a tenth of --steps, then cosine)",
    )
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each 2x2 layout, alternating")
    parser.add_argument(
        "--matchmaking-s", type=float, default=None, help="the sync runs' --averaging-matchmaking-s (peer default 0.5)"
    )
    parser.add_argument(
        "--only",
        nargs="*",
        help="run only these 2x2 layouts: a layout's full name picks it alone, another word every layout whose "
        "name contains it (1 replica always)",
    )
    parser.add_argument(
        "--reference-from",
        help="take the 1-replica run from this earlier output (the same model, steps, batch and schedule) "
        "instead of running it again",
    )
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default="benchmarks/out/replica_speed.json")
    args = parser.parse_args()
    args.period_s = 5.0  # read by benchmarks.replicas.run for periodic runs; none here
    if args.batch_size % (2 * args.microbatch_size):
        parser.error("--batch-size must be a multiple of 2 x --microbatch-size (two replicas share each batch)")

    schedule = tuple(lr_schedule_args(args.steps, None)) if args.schedule == "demo" else ()
    load_before = load()
    print(f"machine load (1/5/15 min) before: {load_before}", flush=True)
    if args.reference_from:
        reference = earlier_reference(args.reference_from, args)
    else:
        reference = run("1 replica", args, 1, "none", schedule)
        reference["load_after"] = load()
    layouts = {n: layout for n, layout in LAYOUTS.items() if not args.only or picked(n, args.only)}
    matchmaking = () if args.matchmaking_s is None else ("--averaging-matchmaking-s", str(args.matchmaking_s))
    runs = []
    for repeat in range(args.repeats):
        for name, (replicas, averaging, extra, trainer_extra) in layouts.items():
            peer_extra = schedule + extra + (matchmaking if averaging == "sync" else ())
            result = run(name, args, replicas, averaging, peer_extra, trainer_extra)
            result.update(repeat=repeat, load_after=load())
            runs.append(result)
    load_after = load()
    print(f"machine load (1/5/15 min) after: {load_after}", flush=True)

    summary = {}
    for name in layouts:
        mine = [r for r in runs if r["name"] == name]
        summary[name] = {
            "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in mine),
            "tokens_per_s_runs": [round(r["tokens_per_s"]) for r in mine],
            "report_tokens_per_s": statistics.mean(r["report_tokens_per_s"] for r in mine),
            "final_loss": statistics.mean(r["final_loss"] for r in mine),
            "eval_loss": statistics.mean(r["eval_loss"] for r in mine),
            "cpu_s_per_step": {
                kind: round(statistics.mean(r["cpu_s_per_step"][kind] for r in mine), 4) for kind in KINDS
            },
        }
    none_speed = summary["2x2 none"]["tokens_per_s"] if "2x2 none" in summary else float("nan")
    for name, s in summary.items():
        s["speed_vs_none"] = s["tokens_per_s"] / none_speed
        s["final_loss_vs_1_replica"] = s["final_loss"] / reference["final_loss"] - 1
        s["eval_loss_vs_1_replica"] = s["eval_loss"] / reference["eval_loss"] - 1

    print(f"\n{'run':<20}{'tokens/s':>10}{'vs none':>9}{'final loss':>12}{'vs 1':>8}{'eval loss':>11}{'vs 1':>8}")
    print(f"{'1 replica':<20}{reference['tokens_per_s']:>10.0f}{'':>9}{reference['final_loss']:>12.4f}{'':>8}"
          f"{reference['eval_loss']:>11.4f}")  # fmt: skip
    for name, s in summary.items():
        print(
            f"{name:<20}{s['tokens_per_s']:>10.0f}{s['speed_vs_none']:>9.2f}{s['final_loss']:>12.4f}"
            f"{s['final_loss_vs_1_replica']:>+8.2%}{s['eval_loss']:>11.4f}{s['eval_loss_vs_1_replica']:>+8.2%}"
        )
    print(f"\nCPU seconds a step, by kind of process (benchmarks/process_cpu.py):\n{'run':<20}"
          + "".join(f"{kind:>14}" for kind in KINDS) + f"{'total':>9}")  # fmt: skip
    for name, row in [("1 replica", reference)] + list(summary.items()):
        if "cpu_s_per_step" in row:  # (not in a reference from before it was measured)
            cpu = row["cpu_s_per_step"]
            print(f"{name:<20}" + "".join(f"{cpu[kind]:>14.3f}" for kind in KINDS) + f"{sum(cpu.values()):>9.3f}")
    write_report(
        args.out,
        {
            "args": vars(args),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "load_after": load_after,
            },
            "reference": reference,
            "runs": runs,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
