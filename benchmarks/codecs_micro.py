"""Codec micro-benchmark (issue #5): encode/decode time, bytes per element and error per codec.

One float32 tensor of 4M normal values (seeded); each codec is warmed up, then timed over
``--repeats`` runs (median and best kept). Prints a table and writes JSON.

    nice -n 10 python benchmarks/codecs_micro.py [--numel 4194304] [--repeats 11] [--threads 1]
        [--out benchmarks/out/codecs_micro.json]

On a busy 2-core machine, torch's default of 2 intra-op threads can be several times slower than
1 (threads wait on each other); record both when comparing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.report_file import write_report  # noqa: E402
from wire.compression import BlockwiseInt8Codec, decode, get_codec  # noqa: E402

CASES = [("none", {}), ("fp16", {}), ("int8", {}), ("topk", {"fraction": 0.01}), ("topk", {"fraction": 0.1})]


def _timed_ms(run, repeats: int) -> tuple[float, float, object]:
    """(median ms, best ms, last result): the best run is the cost without interference from
    other processes on a shared machine, the median what a busy one gives."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), min(times), result


def measure(tensor: torch.Tensor, name: str, params: dict, repeats: int) -> dict:
    codec = get_codec(name, **params)
    decode(codec.encode(tensor))  # warm-up (allocator, bitsandbytes kernels)
    encode_ms, encode_best_ms, encoded = _timed_ms(lambda: codec.encode(tensor), repeats)
    decode_ms, decode_best_ms, restored = _timed_ms(lambda: decode(encoded), repeats)
    relative_l2 = float((restored - tensor).norm() / tensor.norm())
    return {
        "codec": name,
        "params": params,
        "encode_ms": round(encode_ms, 2),
        "decode_ms": round(decode_ms, 2),
        "encode_best_ms": round(encode_best_ms, 2),
        "decode_best_ms": round(decode_best_ms, 2),
        "wire_bytes": encoded.nbytes,
        "bytes_per_element": round(encoded.nbytes / tensor.numel(), 4),
        "ratio_vs_float32": round(tensor.numel() * 4 / encoded.nbytes, 2),
        "parts": len(encoded.parts),
        "relative_l2_error": float(f"{relative_l2:.3g}"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4 * 2**20)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "codecs_micro.json")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warm_up_s = BlockwiseInt8Codec.warm_up()
    tensor = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.seed))
    rows = [measure(tensor, name, params, args.repeats) for name, params in CASES]

    print(
        f"{args.numel:,} float32 values, median of {args.repeats}, {torch.get_num_threads()} torch threads; "
        f"int8 warm-up {warm_up_s:.2f} s"
    )
    print("times in ms as median (best)")
    print(f"{'codec':<18}{'encode':>15}{'decode':>15}{'B/elem':>9}{'ratio':>8}{'parts':>7}{'rel. L2':>10}")
    for row in rows:
        label = row["codec"] + "".join(f" {key}={value}" for key, value in row["params"].items())
        print(
            f"{label:<18}{row['encode_ms']:>8.1f} ({row['encode_best_ms']:>4.1f})"
            f"{row['decode_ms']:>8.1f} ({row['decode_best_ms']:>4.1f})"
            f"{row['bytes_per_element']:>9.3f}"
            f"{row['ratio_vs_float32']:>8.1f}{row['parts']:>7}{row['relative_l2_error']:>10.2g}"
        )

    report = {
        "benchmark": "codecs_micro",
        "numel": args.numel,
        "repeats": args.repeats,
        "seed": args.seed,
        "int8_warm_up_s": round(warm_up_s, 3),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hivemind": version("hivemind"),
            "bitsandbytes": version("bitsandbytes"),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        },
        "results": rows,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
