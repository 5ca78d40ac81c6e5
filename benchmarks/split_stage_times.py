"""Slowest-stage compute time of the equal and profiled splits of `small`, measured in this process
only (no swarm): each stage's forward + backward of one microbatch of 4 on the stage runtime the
peers use, a 2x slower device emulated with the peers' fault slowdown. Three repetitions of the
median of 7, printed per stage in ms. A quick re-check of profiled_split.py's 'measured' column
when the machine is quieter than during a full run.

    nice -n 10 .venv/bin/python benchmarks/split_stage_times.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.profiled_split import measured_stage_times  # noqa: E402

CASES = [
    ("2 stages, stage 1 2x slower", [1.0, 0.5], [(0, 3, 6), (0, 4, 6)]),
    ("3 stages, stage 1 2x slower", [1.0, 0.5, 1.0], [(0, 2, 4, 6), (0, 3, 4, 6), (0, 2, 3, 6)]),
]

if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for label, speeds, splits in CASES:
        for boundaries in splits:
            runs = [measured_stage_times("small", boundaries, speeds, 4, 7) for _ in range(3)]
            print(
                f"{label} {list(boundaries)}: stage ms {[[round(t * 1e3) for t in r] for r in runs]}, "
                f"slowest {[round(max(r) * 1e3) for r in runs]}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f}")
