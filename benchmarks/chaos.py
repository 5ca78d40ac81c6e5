"""Chaos run (issue #11): train on a loopback swarm while random peers are killed and restarted,
a client floods the peers with bad requests, and one replica answers with garbage; then check
that no microbatch was lost, no checkpoint is corrupt, and the loss fell.

    .venv/bin/python benchmarks/chaos.py --out benchmarks/out/chaos.json

Bounded: the trainer runs --steps steps; the whole run gives up after --deadline-s. Exits 1 if a
check fails. Prints what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from dht.announce import fetch_stage_records  # noqa: E402
from dht.node import NetworkConfig, start_dht  # noqa: E402
from dht.records import PeerState  # noqa: E402
from models.config import get_model_config  # noqa: E402
from peers.compute.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from swarm.local_swarm import LocalSwarm, fault_args  # noqa: E402
from swarm.trainer.client import PeerCallError, StageClient  # noqa: E402
from wire.compression import CodecChoice  # noqa: E402
from wire.failures import Failure  # noqa: E402
from wire.tensors import encode_tensor  # noqa: E402


def bad_requests(config):
    """(what, stage, tensors, batch_size, response codec) of requests a peer must refuse."""
    d, t = config.d_model, config.seq_len
    ids = torch.randint(0, config.vocab_size, (2, t))
    return [
        ("nan inputs", 1, [("inputs", torch.full((2, t, d), float("nan"))), ("targets", ids)], 2, "none"),
        ("wrong shape", 1, [("inputs", torch.randn(2, t, d + 1)), ("targets", ids)], 2, "none"),
        ("wrong dtype", 1, [("inputs", torch.randn(2, t, d, dtype=torch.float64)), ("targets", ids)], 2, "none"),
        ("unknown codec", 1, [("inputs", torch.randn(2, t, d)), ("targets", ids)], 2, "zstd"),
        ("batch mismatch", 0, [("inputs", ids)], 3, "none"),
        ("token out of range", 0, [("inputs", ids + 10 * config.vocab_size)], 2, "none"),
    ]


class BadClient:
    """Sends a bad request to a random online peer every `period_s` from its own DHT node."""

    def __init__(self, initial_peers, model: str, num_stages: int, period_s: float, seed: int):
        self.initial_peers, self.model, self.num_stages, self.period_s = initial_peers, model, num_stages, period_s
        self.rng = random.Random(seed)
        self.outcomes: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}  # a few messages of each outcome but "refused"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        dht = start_dht(NetworkConfig(initial_peers=self.initial_peers), client_mode=True)
        try:
            asyncio.run(self._loop(dht))
        finally:
            dht.shutdown()

    async def _loop(self, dht):
        config = get_model_config(self.model)
        client = StageClient(await dht.replicate_p2p(), model=self.model, num_stages=self.num_stages)
        requests = bad_requests(config)
        while not self.stop.is_set():
            what, stage, tensors, batch_size, codec = self.rng.choice(requests)
            records = [r for r in fetch_stage_records(dht, self.model, stage) if r.state == PeerState.ONLINE]
            if records:
                peer_id = self.rng.choice(records).peer_id
                try:
                    await client.call(
                        peer_id,
                        rpc="backward" if stage == 1 else "forward",
                        stage=stage,
                        microbatch_id=f"bad-{time.time()}",
                        batch_size=batch_size,
                        tensors=[(n, encode_tensor(x)) for n, x in tensors],
                        timeout_s=20,
                        response_codec=CodecChoice(codec),
                    )
                    outcome = f"ACCEPTED {what}"  # a check that failed
                except PeerCallError as e:
                    outcome = "refused" if e.kind == Failure.REFUSED else f"{e.kind.value}"
                    if outcome != "refused" and len(self.examples.setdefault(outcome, [])) < 3:
                        self.examples[outcome].append(f"{what}: {str(e)[:200]}")
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            await asyncio.sleep(self.period_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=2, help="healthy replicas per stage")
    parser.add_argument("--kill-period-s", type=float, default=8.0, help="mean seconds between kills")
    parser.add_argument("--min-kills", type=int, default=3, help="fail the run if fewer kills happened")
    parser.add_argument("--restart-after-s", type=float, default=4.0)
    parser.add_argument("--bad-request-period-s", type=float, default=0.5)
    parser.add_argument("--deadline-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/out/chaos.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workdir = tempfile.mkdtemp(prefix="swarm-chaos-")
    peer_args = ["--target-batch-size", "8", "--lr", "3e-3", "--checkpoint-period-s", "3", "--announce-period-s", "2"]
    result: dict = {
        "model": args.model,
        "steps": args.steps,
        "replicas": args.replicas,
        "seed": args.seed,
        "kills": [],
        "restarts": 0,
    }
    started = time.monotonic()
    with LocalSwarm(model=args.model, num_stages=2, workdir=workdir, peer_args=peer_args) as swarm:
        swarm.start_bootstrap()
        slots = {}  # slot name -> (stage, checkpoint dir, process)
        for stage in (0, 1):
            for replica in range(args.replicas):
                name = f"s{stage}r{replica}"
                folder = os.path.join(workdir, f"ckpt-{name}")
                slots[name] = (stage, folder, swarm.start_peer(stage, "--checkpoint-dir", folder))
        garbage = swarm.start_peer(1, *fault_args(garbage="nan", garbage_rate=0.5), name="peer-garbage")
        swarm.wait_online([p for _, _, p in slots.values()] + [garbage])
        bad = BadClient(swarm.initial_peers, args.model, 2, args.bad_request_period_s, args.seed)
        bad.thread.start()
        report_path = os.path.join(workdir, "report.json")
        trainer = swarm.start_trainer(
            "--steps",
            str(args.steps),
            "--batch-size",
            "8",
            "--microbatch-size",
            "2",
            "--num-stages",
            "2",
            "--refresh-period-s",
            "1",
            "--report",
            report_path,
        )
        pending_restarts: list[tuple[float, str]] = []
        next_kill = time.monotonic() + rng.expovariate(1 / args.kill_period_s)
        while trainer.alive and time.monotonic() - started < args.deadline_s:
            now = time.monotonic()
            for due, name in [r for r in pending_restarts if r[0] <= now]:
                pending_restarts.remove((due, name))
                stage, folder, _ = slots[name]
                slots[name] = (stage, folder, swarm.start_peer(stage, "--checkpoint-dir", folder))
                result["restarts"] += 1
            if now >= next_kill:
                down = {name for _, name in pending_restarts}
                candidates = [
                    n
                    for n, (stage, _, p) in slots.items()
                    if n not in down
                    and p.alive
                    and sum(1 for m, (s, _, q) in slots.items() if s == stage and m not in down and q.alive) > 1
                ]
                if candidates:
                    name = rng.choice(sorted(candidates))
                    how = rng.choice(["SIGKILL", "SIGTERM"])
                    process = slots[name][2]
                    process.signal(signal.SIGKILL) if how == "SIGKILL" else process.stop()
                    result["kills"].append({"at_s": round(now - started, 1), "slot": name, "signal": how})
                    pending_restarts.append((now + args.restart_after_s, name))
                next_kill = now + rng.expovariate(1 / args.kill_period_s)
            time.sleep(0.2)
        timed_out = trainer.alive
        if timed_out:
            trainer.stop()
        bad.stop.set()
        bad.thread.join(timeout=30)
        trainer_rc = trainer.popen.wait(timeout=30)
        result["bad_requests"] = dict(bad.outcomes)
        result["bad_request_examples"] = dict(bad.examples)
        result["garbage_peer_alive"] = garbage.alive
        result["peers_alive_at_end"] = sum(p.alive for _, _, p in slots.values())
        swarm.stop()  # peers save a final checkpoint on SIGTERM
    try:
        with open(report_path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {}
    checkpoints = {}
    for path in sorted(glob.glob(os.path.join(workdir, "ckpt-*", "*.ckpt"))):
        try:
            meta, _, _ = load_checkpoint(path)
            checkpoints[os.path.relpath(path, workdir)] = f"ok ({meta.steps_done} steps)"
        except CheckpointError as e:
            checkpoints[os.path.relpath(path, workdir)] = f"CORRUPT: {e}"
    leftovers = glob.glob(os.path.join(workdir, "ckpt-*", "*.tmp.*"))
    losses = report.get("losses", [])
    head, tail = losses[:5], losses[-5:]
    result.update(
        {
            "wall_s": round(time.monotonic() - started, 1),
            "trainer_exit_code": trainer_rc,
            "timed_out": timed_out,
            "completed": report.get("completed", False),
            "steps_done": report.get("steps", 0),
            "microbatches_sent": report.get("microbatches_sent"),
            "microbatches_lost": report.get("microbatches_lost"),
            "microbatches_retried": report.get("microbatches_retried"),
            "failures_by_kind": report.get("failures_by_kind"),
            "loss_first5": sum(head) / len(head) if head else None,
            "loss_last5": sum(tail) / len(tail) if tail else None,
            "checkpoints": checkpoints,
            "temporary_files_left": leftovers,
        }
    )
    checks = {
        f"at least {args.min_kills} peers killed and restarted": len(result["kills"]) >= args.min_kills
        and result["restarts"] >= args.min_kills,
        "trainer completed every step": result["completed"] and result["steps_done"] == args.steps,
        "no microbatch lost": result["microbatches_lost"] == 0,
        "every checkpoint loads": bool(checkpoints) and all(v.startswith("ok") for v in checkpoints.values()),
        "loss fell": bool(head and tail) and result["loss_last5"] < result["loss_first5"] - 0.1,
        "every bad request refused": bool(bad.outcomes) and not any(k.startswith("ACCEPTED") for k in bad.outcomes),
        "garbage answers caught": (result["failures_by_kind"] or {}).get("garbage", 0) > 0,
        "garbage peer still up (banned, not crashed)": result["garbage_peer_alive"],
    }
    result["checks"] = checks
    write_report(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "checkpoints"}, indent=2))
    print(f"{len(checkpoints)} checkpoints: {sorted(set(v.split(' (')[0] for v in checkpoints.values()))}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
