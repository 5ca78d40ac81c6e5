"""Peak memory of a whole `swarm train` process on a large corpus: this code on a prepared folder
against the trainer of before prepared datasets (a checkout of that code, `--before`), which read
its one text file whole into memory (issue #20).

    git worktree add --detach /tmp/before ef7f5c4   # main before the corpus merge
    PYTHONPATH=. .venv/bin/python benchmarks/train_rss.py --corpus DIR --before /tmp/before \
        --out benchmarks/out/train_rss.json

`--corpus DIR` is a folder of text files (benchmarks/data.py builds one); it is prepared with the
byte tokenizer for this code and concatenated into one text file for the code of before. One
loopback swarm of 2 `tiny` peers (one per stage) serves both trainers in turn; each trains
`--steps` steps of batch 32 and its VmHWM (peak RSS) is read from /proc while it runs. The
trainer's DHT daemon and p2pd are separate processes and not counted.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from swarm.data.prepare import PrepareConfig, prepare  # noqa: E402
from swarm.local_swarm import LocalSwarm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss_of_trainer(code: str, data: str, initial_peers: list[str], workdir: str, steps: int) -> dict:
    log_path = os.path.join(workdir, f"trainer-{os.path.basename(code.rstrip('/'))}.log")
    args = [sys.executable, "-m", "swarm.cli", "train", "--initial-peers", *initial_peers, "--model", "tiny"]
    args += ["--num-stages", "2", "--steps", str(steps), "--batch-size", "32", "--microbatch-size", "8"]
    args += ["--data", data, "--metrics-port", "-1"]
    with open(log_path, "w") as log:
        popen = subprocess.Popen(
            args, cwd=code, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": code}
        )
    peak_kb = 0
    while popen.poll() is None:
        try:
            with open(f"/proc/{popen.pid}/status") as f:
                peak_kb = max([peak_kb] + [int(line.split()[1]) for line in f if line.startswith("VmHWM:")])
        except OSError:
            pass
        time.sleep(0.1)
    return {"code": code, "data": data, "exit": popen.returncode, "peak_rss_mb": peak_kb / 1024, "log": log_path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="a folder of text files")
    parser.add_argument("--before", required=True, help="a checkout of the code before prepared datasets")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", default="/tmp/swarm-train-rss")
    parser.add_argument("--out", default="benchmarks/out/train_rss.json")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    files = sorted(glob.glob(os.path.join(args.corpus, "*")))
    text_mb = sum(os.path.getsize(f) for f in files) / 1e6
    prepared = os.path.join(args.workdir, "prepared-bytes")
    prepare(PrepareConfig(inputs=files, out=prepared, tokenizer="bytes"))
    single = os.path.join(args.workdir, "corpus.txt")
    if not os.path.isfile(single):
        with open(single + ".partial", "wb") as out:
            for path in files:
                with open(path, "rb") as f:
                    out.write(f.read())
        os.replace(single + ".partial", single)
    report = {"machine": platform.platform(), "load_before": os.getloadavg(), "corpus_mb": text_mb, "runs": []}
    with LocalSwarm(model="tiny", num_stages=2, workdir=os.path.join(args.workdir, "swarm")) as swarm:
        peers_at = swarm.start_bootstrap()
        swarm.wait_online([swarm.start_peer(0), swarm.start_peer(1)])
        for code, data in ((REPO, prepared), (os.path.abspath(args.before), single)):
            report["runs"].append(peak_rss_of_trainer(code, data, peers_at, swarm.workdir, args.steps))
            print(report["runs"][-1], flush=True)
    report["load_after"] = os.getloadavg()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
