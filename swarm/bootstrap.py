"""`swarm dht`: a bootstrap DHT node that other processes join. It holds no model."""

from __future__ import annotations

import dataclasses
import os
import threading

from dht.node import NetworkConfig, start_dht
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


def run_bootstrap(config: BootstrapConfig) -> int:
    if config.maddrs_file:  # a killed node's half-written address file
        remove_stale_temporaries(
            os.path.dirname(os.path.abspath(config.maddrs_file)), f"{os.path.basename(config.maddrs_file)}.tmp.*"
        )
    dht = start_dht(config, models=config.models)
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        print("DHT bootstrap node is up. Join it with:", flush=True)
        for maddr in maddrs:
            print(f"  --initial-peers {maddr}", flush=True)
        if config.maddrs_file:
            write_atomically(config.maddrs_file, "\n".join(maddrs) + "\n")
        stop = threading.Event()
        ShutdownSignals(stop.set, what="stopping the DHT node").install()
        while not stop.wait(1.0):  # a timed wait: the main thread runs the signal handler between waits
            pass
    finally:
        dht.shutdown()
    print("DHT bootstrap node stopped", flush=True)
    return 0
