"""`swarm dht`: a bootstrap DHT node that other processes join. It holds no model.

With `--run DIR` (a run's folder, from `swarm run create`) it announces the run's spec under its own
peer id, renewed, and again whenever `swarm run update` rewrites it: processes given this node's
address take the run it announces (dht/run_specs.py), whatever else the DHT holds."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from dht.authority import load_run
from dht.node import NetworkConfig, start_dht
from dht.run_specs import SPEC_TTL_S, SpecError, announce_spec
from peers.run_spec import parse_spec, read_owner_spec
from process.atomic_files import remove_stale_temporaries, write_atomically
from process.config import option
from process.lifetime import ShutdownSignals


@dataclasses.dataclass(kw_only=True)
class BootstrapConfig(NetworkConfig):
    maddrs_file: str | None = option(None, help="also write the node's multiaddrs to this file, one per line")
    models: list[str] = option(
        default_factory=list,
        help="models whose DHT keys this node guards: it stores only signed records there, within "
        "caps (peers and trainers guard their own model's keys in any case)",
    )
    run: str | None = option(
        None,
        help="a run's folder (from `swarm run create`): announce its spec, so that processes given this "
        "node's address join that run",
    )


def run_bootstrap(config: BootstrapConfig) -> int:
    if config.maddrs_file:  # a killed node's half-written address file
        remove_stale_temporaries(
            os.path.dirname(os.path.abspath(config.maddrs_file)), f"{os.path.basename(config.maddrs_file)}.tmp.*"
        )
    spec = _run_spec(config.run) if config.run else None
    models = [*config.models, *([spec[1].model] if spec and spec[1].model not in config.models else [])]
    dht = start_dht(config, models=models)
    try:
        announced = _announce_run(dht, config.run, (None, 0.0)) if config.run else None  # before the address is out
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        print("DHT bootstrap node is up. Join it with:", flush=True)
        for maddr in maddrs:
            print(f"  --initial-peers {maddr}", flush=True)
        if config.maddrs_file:
            write_atomically(config.maddrs_file, "\n".join(maddrs) + "\n")
        stop = threading.Event()
        ShutdownSignals(stop.set, what="stopping the DHT node").install()
        while not stop.wait(1.0):  # a timed wait: the main thread runs the signal handler between waits
            if config.run:
                announced = _announce_run(dht, config.run, announced)
    finally:
        dht.shutdown()
    print("DHT bootstrap node stopped", flush=True)
    return 0


def _run_spec(run_dir: str):
    """(signed, parsed) spec of the run's folder; SpecError (one line) when it has none or a bad one."""
    signed = read_owner_spec(run_dir, load_run(run_dir).owner_public_key)
    if signed is None:
        raise SpecError(f"--run {run_dir}: no spec.json there (`swarm run create` writes one)")
    return signed, parse_spec(signed)


def _announce_run(dht, run_dir: str, announced: tuple):
    """Announce the folder's spec when it changed or half its lifetime has passed; returns what was."""
    try:
        signed, spec = _run_spec(run_dir)
    except ValueError as e:  # a spec being rewritten, or broken: keep the last one announced
        print(f"--run {run_dir}: {e}", flush=True)
        return announced
    text, at = announced
    if signed.payload == text and time.monotonic() - at < SPEC_TTL_S / 2:
        return announced
    if announce_spec(dht, signed, ttl_s=SPEC_TTL_S):
        if signed.payload != text:
            print(f"announcing run {spec.run_id} version {spec.version} ({spec.model})", flush=True)
        return signed.payload, time.monotonic()
    return announced
