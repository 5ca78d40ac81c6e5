"""Tokens/s of a 124M-shape GPT on one GPU: a 2-stage swarm (two peer processes sharing the GPU,
the trainer and the wire on loopback) next to one plain PyTorch process on the same GPU, each with
AdamW and with bitsandbytes' 8-bit AdamW. Issue #12. Also each layout's peak GPU memory: the
plain process's allocator peak, and each peer's (`swarm_peer_device_memory_peak_bytes`, read from
its metrics endpoint at the end of the run).

    python benchmarks/gpu.py --out benchmarks/out/gpu.json

Defaults: model gpt2-124m (GPT-2 124M shapes, 1024-token context, GPT-2's 50257-token vocabulary
over byte-level text; 163M parameters because the head is not tied to the embedding), fp32, batch
16 in microbatches of 4, 3 warm-up steps then 10 timed steps per layout. Refuses to run without a
CUDA GPU (exit 2). `--device cpu --model tiny` runs the same code on the CPU as a smoke test of the
script only: those figures say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch
from tokenizers import Tokenizer, models

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_metrics import scrape_peer  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import build_full_model  # noqa: E402
from peers.compute import devices  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings  # noqa: E402
from swarm.data.prepare import PrepareConfig, prepare  # noqa: E402
from swarm.data.tokenizer import byte_tokenizer  # noqa: E402
from swarm.local_swarm import LocalSwarm, LocalSwarmError  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, load_corpus, shakespeare_files  # noqa: E402

BYTES = 256


def padded_byte_tokenizer(vocab_size: int) -> Tokenizer:
    """The byte tokenizer (token id = the byte's value) with `vocab_size` entries: ids from 256 on
    are placeholders that no text encodes to."""
    tokenizer = byte_tokenizer()
    vocab = tokenizer.get_vocab()
    vocab.update({f"<unused{i}>": i for i in range(BYTES, vocab_size)})
    tokenizer.model = models.BPE(vocab=vocab, merges=[])
    return tokenizer


def byte_data(vocab_size: int, workdir: str) -> list[str]:
    """The trainer's `--data` for a model of `vocab_size` tokens: the corpus's bytes, what the plain
    process trains on. The trainer refuses data whose vocabulary is not the swarm's, so for a larger
    vocabulary (GPT-2's 50257) the corpus is prepared with the byte tokenizer padded to that size:
    ids 0-255 are the bytes, the other ids are never produced."""
    if vocab_size == BYTES:
        return []  # the trainer's default data: the corpus's bytes
    path = os.path.join(workdir, "tokenizer.json")
    padded_byte_tokenizer(vocab_size).save(path)
    out = os.path.join(workdir, "data")
    prepare(PrepareConfig(inputs=shakespeare_files(), out=out, tokenizer=path), say=lambda line: None)
    return ["--data", out]


def plain_pytorch(
    model_name: str,
    device: torch.device,
    optimizer: str,
    precision: str,
    steps: int,
    warmup: int,
    batch_size: int,
    microbatch_size: int,
) -> dict:
    """One process, the whole model on `device`, gradient accumulation over the same microbatches."""
    config = get_model_config(model_name)
    sampler = MicrobatchSampler(
        load_corpus(), seq_len=config.seq_len, batch_size=batch_size, microbatch_size=microbatch_size
    )
    model = build_full_model(config).to(device)
    opt = OptimizerSettings(optimizer=optimizer).build(model.parameters(), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, started = [], None
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            started = time.perf_counter()
        total = torch.zeros((), device=device)
        for mb in sampler.batch(step):
            with devices.autocast(device, precision):
                loss = model(mb.inputs.to(device), mb.targets.to(device)) * (mb.size / batch_size)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))  # one sync per step, as a user's logging loop would
    _sync(device)
    elapsed = time.perf_counter() - started
    result = {
        "layout": layout_name(plain_pytorch, device, optimizer),
        "tokens_per_s": steps * batch_size * config.seq_len / elapsed,
        "final_loss": sum(losses[-3:]) / len(losses[-3:]),
    }
    if device.type == "cuda":
        result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def swarm_run(
    model_name: str,
    device: torch.device,
    optimizer: str,
    precision: str,
    steps: int,
    warmup: int,
    batch_size: int,
    microbatch_size: int,
    max_in_flight: int,
) -> dict:
    """Two peers (stage 0 and stage 1) computing on `device`, a trainer streaming microbatches."""
    config = get_model_config(model_name)
    workdir = tempfile.mkdtemp(prefix="swarm-gpu-bench-")
    report_path = os.path.join(workdir, "report.json")
    peer_args = [
        "--device",
        str(device),
        "--precision",
        precision,
        "--optimizer",
        optimizer,
        "--target-batch-size",
        str(batch_size),
        "--max-batch-size",
        str(microbatch_size),
        "--num-threads",
        "1",
    ]
    with LocalSwarm(model=model_name, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(stage) for stage in range(2)]
        swarm.wait_online(peers, timeout_s=600)
        trainer = swarm.start_trainer(
            "--steps",
            str(warmup + steps),
            "--batch-size",
            str(batch_size),
            "--microbatch-size",
            str(microbatch_size),
            "--max-in-flight",
            str(max_in_flight),
            "--num-stages",
            "2",
            "--report",
            report_path,
            *byte_data(config.vocab_size, workdir),
        )
        if trainer.popen.wait(timeout=3600) != 0:
            raise RuntimeError(f"trainer failed:\n{trainer.log()[-3000:]}")
        peaks = [peer_gauge(peer.log(), "swarm_peer_device_memory_peak_bytes") for peer in peers]
    with open(report_path) as f:
        report = json.load(f)
    timed = report["tokens_per_s_by_step"][warmup:]
    tokens = batch_size * config.seq_len
    seconds = sum(tokens / rate for rate in timed)
    return {
        "layout": layout_name(swarm_run, device, optimizer),
        "tokens_per_s": len(timed) * tokens / seconds,
        "final_loss": report["final_loss"],
        "microbatches_lost": report["microbatches_lost"],
        # each peer's peak GPU memory, from its metrics endpoint (None: not read)
        "peers_peak_gpu_memory_gib": [None if b is None else b / 2**30 for b in peaks],
    }


def peer_gauge(log: str, name: str) -> float | None:
    """A gauge from the metrics endpoint a peer's log names (None if it cannot be read)."""
    values = [s.value for s in scrape_peer(log) or () if s.name == name]
    return values[0] if values else None


def layout_name(run, device: torch.device, optimizer: str) -> str:
    """The name of `run`'s row (plain_pytorch or swarm_run) in the table and the JSON."""
    return (
        f"plain pytorch, {optimizer}" if run is plain_pytorch else f"swarm 2 stages on one {device.type}, {optimizer}"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N (cpu: smoke test of this script only)")
    parser.add_argument("--precision", default="fp32", choices=list(devices.PRECISIONS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--optimizers", default="adamw,adamw8bit")
    parser.add_argument("--out", default="benchmarks/out/gpu.json")
    args = parser.parse_args()
    try:
        device = devices.resolve_device(args.device)
        devices.check_precision(device, args.precision)
        optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
        for optimizer in optimizers:
            devices.check_optimizer(optimizer, device)
    except devices.DeviceError as e:
        print(f"benchmarks/gpu.py: error: {e}", file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.device.startswith("cpu"):
        print("benchmarks/gpu.py: error: no CUDA GPU here; this benchmark measures a GPU", file=sys.stderr)
        return 2
    print(
        f"device: {devices.describe_device(device)}; model {args.model} "
        f"({get_model_config(args.model).num_parameters() / 1e6:.0f}M parameters); precision {args.precision}",
        flush=True,
    )

    results = []
    for optimizer in optimizers:
        for run in (plain_pytorch, swarm_run):
            kwargs = dict(
                steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, microbatch_size=args.microbatch_size
            )
            if run is swarm_run:
                kwargs["max_in_flight"] = args.max_in_flight
            try:
                results.append(run(args.model, device, optimizer, args.precision, **kwargs))
            except (LocalSwarmError, RuntimeError, OSError) as e:  # the other layouts still run and are kept
                layout = layout_name(run, device, optimizer)
                results.append({"layout": layout, "error": str(e)})
                print(f"{layout:<40} failed: {e}", flush=True)
                continue
            print(f"{results[-1]['layout']:<40} {results[-1]['tokens_per_s']:>10,.0f} tokens/s", flush=True)
    measured = [r for r in results if "error" not in r]
    for r in measured:
        optimizer = r["layout"].rsplit(", ", 1)[1]
        plain = next((p for p in measured if p["layout"] == layout_name(plain_pytorch, device, optimizer)), None)
        r["ratio_to_plain_same_optimizer"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain else None
    print("\nlayout                                     tokens/s   ratio   final loss   peak GPU memory (GiB)")
    for r in measured:
        ratio = r["ratio_to_plain_same_optimizer"]
        peaks = r.get("peers_peak_gpu_memory_gib", [r.get("peak_gpu_memory_gib")])
        memory = " + ".join("?" if p is None else f"{p:.2f}" for p in peaks)
        print(
            f"{r['layout']:<40} {r['tokens_per_s']:>10,.0f}   {'-' if ratio is None else f'{ratio:.2f}':>5}    "
            f"{r['final_loss']:>10.3f}   {memory}"
        )
    out = {
        "benchmark": "gpu",
        "model": args.model,
        "device": devices.describe_device(device),
        "precision": args.precision,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "microbatch_size": args.microbatch_size,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "results": results,
    }
    write_report(args.out, out)
    return 1 if len(measured) < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
