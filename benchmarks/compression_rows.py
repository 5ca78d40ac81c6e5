"""The in-process convergence table (issue #27) with its rows run side by side: one
`benchmarks/compression.py --in-process` process per row, `--jobs` at a time, then one merged JSON
and table. On a machine with many cores (or one GPU that a single row leaves mostly idle) the table
takes the time of its slowest row instead of the sum of them. Loss at equal tokens does not depend
on what runs beside a row; its wall time does, so no speed is read from this.

    python benchmarks/compression_rows.py --jobs 13 --rows fp32,fp32@1,int8,int4,fixed:16 \\
        --out benchmarks/out/compression_rows.json -- --model medium --stages 4 --device cuda \\
        --tokens 2000000 --eval-batches 16 --threads 1

A row is anything `--codecs` takes (fp32, int8, int4/fp32, fixed:32+int4, ...), optionally with
`@SEED` (default: the seed among the passed arguments, else 0). Everything after `--` goes to every
row's compression.py unchanged. The ratios to fp32 are taken against the `fp32` row of the first
seed named. A row that fails or runs past `--row-timeout-s` is reported as missing, the rest are
kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compression_in_process import FP32_LABEL, compare_to_fp32, table_lines  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from swarm.trainer.data import open_data  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compression.py")


def parse_rows(text: str, default_seed: int) -> list[tuple[str, int]]:
    """`fp32,int8@1` -> [("fp32", default_seed), ("int8", 1)]; ValueError on an empty row or a bad seed."""
    rows = []
    for item in text.split(","):
        name, at, seed = item.strip().partition("@")
        if not name or (at and not seed.isdigit()):
            raise ValueError(f"{item!r}: a row is CODEC or CODEC@SEED")
        rows.append((name, int(seed) if at else default_seed))
    return rows


def _run_row(name: str, seed: int, passed: list[str], out: str, timeout_s: float, lock: threading.Lock) -> int:
    """One row in its own process (`passed`: the arguments for every row, without --seed); its output
    lines prefixed with the row, as they come."""
    tag = f"[{name}@{seed}]"
    command = [sys.executable, SCRIPT, "--in-process", *passed, "--codecs", name, "--seed", str(seed), "--out", out]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                with lock:
                    print(f"{tag} {line.rstrip()}", flush=True)
        finally:
            timer.cancel()
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, passed = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", required=True, help="comma-separated rows, each CODEC or CODEC@SEED")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="rows at a time")
    parser.add_argument("--row-timeout-s", type=float, default=3600.0, help="a row still running after this is killed")
    parser.add_argument("--out", default="benchmarks/out/compression_rows.json", help="the merged JSON report")
    args = parser.parse_args(own)
    # the --seed passed to all is the rows' default; each row's process gets its own
    seeds = argparse.ArgumentParser(prog="compression_rows: the arguments after --", add_help=False)
    seeds.add_argument("--seed", type=int, default=0)
    seed, passed = seeds.parse_known_args(passed)
    try:
        rows = parse_rows(args.rows, seed.seed)
    except ValueError as e:
        parser.exit(2, f"compression_rows: error: --rows {e}\n")
    if "--in-process" in passed or "--codecs" in passed or "--out" in passed:
        parser.exit(2, "compression_rows: error: --in-process, --codecs and --out are this script's to set\n")
    open_data(None, say=lambda *_: None)  # prepare the corpus once, before the rows race to it
    started, load_at_start = time.monotonic(), os.getloadavg()
    lock, results = threading.Lock(), {}
    with tempfile.TemporaryDirectory(prefix="compression-rows-") as folder:
        paths = {row: os.path.join(folder, f"row{i}.json") for i, row in enumerate(rows)}
        pending = list(rows)

        def worker() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    row = pending.pop(0)
                rc = _run_row(*row, passed, paths[row], args.row_timeout_s, lock)
                with lock:
                    results[row] = rc

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(args.jobs, len(rows))))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        reports = {
            row: json.loads(Path(paths[row]).read_text())
            for row in rows
            if results.get(row) == 0 and os.path.exists(paths[row])
        }
    if not reports:
        print("compression_rows: no row finished", file=sys.stderr)
        return 1
    first_seed = rows[0][1]
    merged_rows = []
    for (name, seed), report in reports.items():
        for row in report["results"]:
            row["seed"] = seed
            row["wall_s"] = report["wall_s"]
            if seed != first_seed and row["label"] == FP32_LABEL:
                row["label"] = f"{FP32_LABEL}@{seed}"  # compared with the first seed's fp32, not itself
            merged_rows.append(row)
    compare_to_fp32(merged_rows)
    template = next(iter(reports.values()))
    out = {
        **{
            k: v
            for k, v in template.items()
            if k not in ("results", "command", "seed", "wall_s", "load_average_at_start", "load_average_at_end")
        },
        "benchmark": "compression_rows",
        "command": " ".join(["benchmarks/compression_rows.py", *argv]),
        "seeds": sorted({seed for _, seed in rows}),
        "missing": [f"{name}@{seed}" for name, seed in rows if (name, seed) not in reports],
        "results": merged_rows,
        "jobs": args.jobs,
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "wall_s": time.monotonic() - started,
    }
    for line in table_lines(out):
        print(line)
    if out["missing"]:
        print(f"missing (failed or timed out): {', '.join(out['missing'])}")
    write_report(args.out, out)
    return 0 if not out["missing"] else 1


if __name__ == "__main__":
    sys.exit(main())
