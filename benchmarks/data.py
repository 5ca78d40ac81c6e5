"""The data pipeline at scale: `swarm data prepare` throughput (MB/s of text, tokenizer training
included) and the trainer's peak memory reading its data, on corpora made from the texts installed
with the packages (no download).

    .venv/bin/python benchmarks/data.py --sizes-mb 50 200 --out benchmarks/out/data.json

The corpus of N MB: the 42 Shakespeare texts of the `shakespeare` package plus every .txt, .md,
.rst and LICENSE* file over 1 kB under site-packages (~26 MB of distinct text), written round-robin
into 4 MB files under /tmp/swarm-data-bench/corpus-N until N MB; past ~26 MB the text repeats, which
flatters neither the tokenizer nor the memory (the shards hold every token, repeated or not).

Memory: a fresh subprocess imports torch and the trainer's data module, then (a) opens the prepared
folder and draws the batches of `--steps` steps (batch 32 x 128 tokens, the small model's shape)
plus 4 validation batches, as `swarm train` does, or (b) loads the corpus the way the trainer did
before prepared datasets (`load_corpus`: every byte in memory, joined) and draws the same batches.
Peak RSS is the subprocess's ru_maxrss; the baseline is the same subprocess drawing nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.data.prepare import PrepareConfig, prepare  # noqa: E402
from swarm.trainer.data import shakespeare_files  # noqa: E402

ROOT = "/tmp/swarm-data-bench"
FILE_BYTES = 4 << 20


def source_texts() -> list[str]:
    site = next(p for p in sys.path if p.endswith("site-packages"))
    found = []
    for pattern in ("**/*.txt", "**/*.md", "**/*.rst", "**/LICENSE*"):
        found += [p for p in glob.glob(os.path.join(site, pattern), recursive=True) if os.path.isfile(p)]
    found = sorted({p for p in found if os.path.getsize(p) > 1024})
    return shakespeare_files() + found


def build_corpus(size_mb: int) -> str:
    folder = os.path.join(ROOT, f"corpus-{size_mb}")
    if os.path.isdir(folder):
        return folder
    partial = folder + ".partial"
    os.makedirs(partial, exist_ok=True)
    texts = source_texts()
    written, index, out = 0, 0, None
    target = size_mb * 1_000_000
    while written < target:
        for path in texts:
            if written >= target:
                break
            with open(path, "rb") as f:
                data = f.read()
            if out is None or out.tell() >= FILE_BYTES:
                if out:
                    out.close()
                out = open(os.path.join(partial, f"part-{index:05d}.txt"), "wb")
                index += 1
            out.write(data + b"\n\n")
            written += len(data) + 2
    out.close()
    os.replace(partial, folder)
    return folder


def measure_prepare(corpus: str, tokenizer: str) -> dict:
    out = os.path.join(ROOT, f"prepared-{os.path.basename(corpus)}-{tokenizer.replace(':', '')}")
    if os.path.isdir(out):
        import shutil

        shutil.rmtree(out)
    text_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(corpus, "*")))
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    meta = prepare(PrepareConfig(inputs=[corpus], out=out, tokenizer=tokenizer), say=print)
    seconds = time.perf_counter() - started
    return {
        "corpus": corpus,
        "tokenizer": tokenizer,
        "folder": out,
        "text_mb": text_bytes / 1e6,
        "seconds": seconds,
        "mb_per_s": text_bytes / 1e6 / seconds,
        "train_tokens": meta.splits["train"].tokens,
        "val_tokens": meta.splits["val"].tokens,
        "vocab_size": meta.vocab_size,
        "dtype": meta.dtype,
        "bench_process_peak_rss_mb_after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bench_process_peak_rss_mb_before": before / 1024,
    }


CHILD = r"""
import glob, json, os, resource, sys
import numpy as np, torch
from swarm.trainer.data import MicrobatchSampler, open_training_data, validation_batches
mode, path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "prepared":
    data = open_training_data(path)
    train, val = data.train, data.val
elif mode == "in-memory":  # the trainer's loader before prepared datasets (load_corpus), over every file
    chunks = []
    for file in sorted(glob.glob(os.path.join(path, "*"))):
        with open(file, "rb") as f:
            chunks.append(f.read())
    joined = b"\n".join(chunks)
    del chunks
    train = torch.from_numpy(np.frombuffer(joined, dtype=np.uint8).copy())
    del joined
    val = train
if mode != "baseline":
    sampler = MicrobatchSampler(train, seq_len=128, batch_size=32, microbatch_size=4)
    checksum = 0
    for step in range(steps):
        checksum += sum(int(mb.inputs.sum()) for mb in sampler.batch(step))
    for batch in validation_batches(val, seq_len=128, batch_size=32, microbatch_size=4, batches=4):
        checksum += sum(int(mb.inputs.sum()) for mb in batch)
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure_memory(mode: str, path: str, steps: int) -> float:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, path, str(steps)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": repo},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--bpe", default="bpe:4096", help="the BPE tokenizer measured on the largest corpus")
    parser.add_argument("--steps", type=int, default=200, help="training steps of batches drawn in the memory test")
    parser.add_argument("--out", default="benchmarks/out/data.json")
    args = parser.parse_args()
    report = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "steps": args.steps,
        "prepare": [],
        "memory": [],
    }
    report["memory"].append({"mode": "baseline", "peak_rss_mb": measure_memory("baseline", "-", 0)})
    for size in args.sizes_mb:
        corpus = build_corpus(size)
        tokenizers = ["bytes"] + ([args.bpe] if size == max(args.sizes_mb) else [])
        for tokenizer in tokenizers:
            result = measure_prepare(corpus, tokenizer)
            print(json.dumps(result), flush=True)
            report["prepare"].append(result)
            rss = measure_memory("prepared", result["folder"], args.steps)
            report["memory"].append({"mode": f"prepared {tokenizer}", "corpus_mb": size, "peak_rss_mb": rss})
            print(report["memory"][-1], flush=True)
        rss = measure_memory("in-memory", corpus, args.steps)
        report["memory"].append({"mode": "in-memory bytes (before)", "corpus_mb": size, "peak_rss_mb": rss})
        print(report["memory"][-1], flush=True)
    report["load_after"] = os.getloadavg()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
