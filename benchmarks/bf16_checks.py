"""The figures behind tests/unit/test_bf16_checks.py (issue #59): three bf16 replicas of `tiny`, one
lying by 3%, 1,000 checked calls, in one process.

    .venv/bin/python benchmarks/bf16_checks.py --out benchmarks/out/bf16_checks.json

Runs the unit test's loop as it is (its assertions included: no honest replica in a minority, the
liar always), recording every verdict the trainer's `judge` gave: checks per call kind, how many
needed a third answer, how often the liar and an honest replica were in the minority, and the
largest share of the tolerance that two agreeing answers used (the honest bf16 margin).

What it does not show: real processes (tests/integration/test_checks_every_call.py does that for
fewer calls), other hardware's bf16 kernels (no GPU lent), a model other than `tiny`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.trainer import spot_checks  # noqa: E402
from tests.unit import test_bf16_checks as loop  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/bf16_checks.json")
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.monotonic()
    verdicts = []

    def recording_judge(answers, codec):
        verdict = spot_checks.judge(answers, codec)
        verdicts.append((tuple(answers), verdict))
        return verdict

    loop.judge = recording_judge
    loop.test_over_a_thousand_checks_no_honest_bf16_replica_is_outvoted_and_the_liar_always_is()
    final = {}  # one check = its last verdict (a second one when a third answer was asked)
    asked_third = 0
    for i, (names, verdict) in enumerate(verdicts):
        if len(names) == 3:
            asked_third += 1
        if i + 1 == len(verdicts) or len(verdicts[i + 1][0]) == 2:
            final[i] = (names, verdict)
    checks = list(final.values())
    honest_only = [v for names, v in checks if "liar" not in names]
    report = {
        "command": " ".join(sys.argv),
        "calls_checked": len(checks),
        "checks_of_the_liars_calls": sum(names[0] == "liar" for names, _ in checks),
        "checks_of_honest_calls_the_liar_answered": sum(names[0] != "liar" and "liar" in names for names, _ in checks),
        "checks_asking_a_third_answer": asked_third,
        "liar_in_minority": sum(v.minority == ("liar",) for _, v in checks),
        "honest_in_minority": sum(any(m != "liar" for m in v.minority) for _, v in checks),
        "honest_pairs_largest_agreeing_share": max(v.largest_agreeing_share for v in honest_only),
        "honest_pairs_largest_agreeing_difference": max(v.largest_agreeing_difference for v in honest_only),
        "all_checks_largest_agreeing_share": max(v.largest_agreeing_share for _, v in checks),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(report, flush=True)
    write_report(args.out, report)
    return 0 if report["honest_in_minority"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
