"""Adapters against full fine-tuning (issue #28): the bytes one averaging round moves between the
two replicas of a stage, on a 2x2 loopback swarm, with `--trainable all` and `--trainable lora:R`.

    .venv/bin/python benchmarks/lora_averaging.py --out benchmarks/out/lora_averaging.json

For each mode: a real loopback swarm (`LocalSwarm`) of 2 stages x 2 replicas averaging gradients
on every step (`--averaging sync`, no compression), trained by `swarm train` for `--steps` steps on
the Shakespeare corpus; per peer, the averaging bytes it sent and the rounds it took (its Prometheus
endpoint), hence bytes per round; the trainer's losses; the trainable values of each stage. The
bytes follow from the trainable values (4 bytes each, plus framing); the losses are those of a few
steps and say only that training moves, not how well adapters fine-tune.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import urllib.request
from dataclasses import replace

import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.lora import add_adapters  # noqa: E402
from models.stages import build_stage  # noqa: E402
from swarm.local_swarm import LocalSwarm  # noqa: E402


def averaging_figures(log: str) -> tuple[float, float]:
    """(bytes sent for averaging, rounds that succeeded) from a peer's Prometheus endpoint."""
    match = re.search(r"metrics on (http://\S+/metrics)", log)
    if not match:
        raise SystemExit(f"a peer announced no metrics endpoint:\n{log[-2000:]}")
    with urllib.request.urlopen(match.group(1), timeout=10) as response:
        samples = [s for f in text_string_to_metric_families(response.read().decode()) for s in f.samples]
    sent = sum(
        s.value for s in samples if s.name == "swarm_peer_averaging_bytes_total" and s.labels["direction"] == "sent"
    )
    rounds = sum(
        s.value for s in samples if s.name == "swarm_peer_averaging_rounds_total" and s.labels["result"] == "ok"
    )
    return sent, rounds


def trainable_values(model: str, trainable: str, stage: int) -> int:
    config = replace(get_model_config(model), trainable=trainable)
    module = build_stage(config, stage, 2)
    if trainable == "all":
        return sum(p.numel() for p in module.parameters())
    return add_adapters(module, int(trainable.split(":")[1]))


def run(args, trainable: str) -> dict:
    workdir = tempfile.mkdtemp(prefix="swarm-lora-")
    report_path = os.path.join(workdir, "report.json")
    peer_args = ["--trainable", trainable, "--averaging", "sync", "--lr", str(args.lr)]
    peer_args += ["--target-batch-size", str(args.batch_size)]
    with LocalSwarm(model=args.model, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(stage) for stage in (0, 0, 1, 1)]
        swarm.wait_online(peers, timeout_s=300)
        trainer = swarm.start_trainer(
            "--trainable",
            trainable,
            "--num-stages",
            "2",
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--microbatch-size",
            str(args.microbatch_size),
            "--report",
            report_path,
        )
        if trainer.popen.wait(timeout=args.run_timeout_s) != 0:
            raise SystemExit(f"the trainer failed:\n{trainer.log()[-3000:]}")
        per_peer = []
        for stage, peer in zip((0, 0, 1, 1), peers):
            sent, rounds = averaging_figures(peer.log())
            per_peer.append(dict(stage=stage, bytes_sent=sent, rounds=rounds))
    with open(report_path) as f:
        losses = json.load(f)["losses"]
    stages = []
    for stage in (0, 1):
        peers_of_stage = [p for p in per_peer if p["stage"] == stage]
        rounds = sum(p["rounds"] for p in peers_of_stage)
        stages.append(
            dict(
                stage=stage,
                trainable_values=trainable_values(args.model, trainable, stage),
                bytes_per_round_per_replica=sum(p["bytes_sent"] for p in peers_of_stage) / rounds if rounds else None,
                peers=peers_of_stage,
            )
        )
    return dict(trainable=trainable, losses=losses, stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", default="benchmarks/out/lora_averaging.json")
    args = parser.parse_args()
    runs = [run(args, "all"), run(args, f"lora:{args.rank}")]
    for result in runs:
        for stage in result["stages"]:
            print(
                f"{result['trainable']:>7} stage {stage['stage']}: {stage['trainable_values']:,} trainable values, "
                f"{stage['bytes_per_round_per_replica']:,.0f} bytes sent per replica per round; "
                f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}",
                flush=True,
            )
    write_report(
        args.out,
        dict(
            benchmark="lora_averaging",
            args=vars(args),
            machine=dict(platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__),
            runs=runs,
        ),
    )


if __name__ == "__main__":
    main()
