"""`swarm monitor targets --out FILE`: keep a Prometheus `file_sd` file of every peer's metrics
endpoint up to date from the DHT, so Prometheus finds peers by itself as they come and go.

The targets are what the peers announce (`metrics_addr` in their records); with
`--allowed-peers` (a private swarm), only the listed peers' addresses are written. A peer stays listed
until it announces `offline` or its record expires, so a DHT lookup that times out once does not
empty the file. The file is rewritten atomically, and only when its content changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import re
import signal
from collections.abc import Collection, Iterable

from hivemind.utils import get_dht_time

from dht.announce import fetch_stage_records_async
from dht.node import NetworkConfig, start_dht
from dht.records import PeerRecord, PeerState
from process.config import ConfigError, option
from swarm.bootstrap import write_atomically

logger = logging.getLogger(__name__)

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
    r"[A-Za-z0-9])?)*$"
)


@dataclasses.dataclass(kw_only=True)
class MonitorConfig(NetworkConfig):
    out: str | None = option(None, help="file_sd JSON file to write (point a Prometheus file_sd_configs entry at it)")
    model: str = option("small", help="model whose peers to list")
    num_stages: int | None = option(None, help="number of stages (default: the largest any peer announces)")
    period_s: float = option(15.0, help="re-read the DHT and rewrite the file (if it changed) this often")
    lookup_timeout_s: float = option(10.0, help="timeout of one DHT lookup")
    once: bool = option(False, help="write the file once and exit (for cron or a test)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.out:
            raise ConfigError("--out is required (the file_sd JSON file to keep up to date)")
        folder = os.path.dirname(os.path.abspath(self.out))
        if not os.path.isdir(folder):
            raise ConfigError(f"--out {self.out!r}: the folder {folder!r} does not exist")
        if self.period_s <= 0 or self.lookup_timeout_s <= 0:
            raise ConfigError("--period-s and --lookup-timeout-s must be positive")
        if self.num_stages is not None and self.num_stages < 1:
            raise ConfigError("--num-stages must be at least 1")


# --- pure parts ----------------------------------------------------------------------------------
def parse_metrics_addr(text: str) -> str:
    """Validate an announced `host:port` (host an IP, [IPv6] or a DNS name); returns it normalised.
    Raises ValueError: the value comes from other peers and must not break the file."""
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]]+):(\d{1,5})", text.strip())
    if not match:
        raise ValueError(f"not host:port: {text!r}")
    host, port = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port out of range: {text!r}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ValueError(f"not an IP address or host name: {text!r}") from None
        return f"{host.lower()}:{int(port)}"
    if ip.is_unspecified:
        raise ValueError(f"{text!r} is a wildcard address, not one to scrape")
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def merge_records(known: dict[str, PeerRecord], fresh: Iterable[PeerRecord], now: float) -> dict[str, PeerRecord]:
    """Peers to list, by peer id: the fresh records replace older ones, a peer that announced
    `offline` leaves at once, and any other peer leaves when its record expires."""
    merged = dict(known)
    for record in fresh:
        current = merged.get(record.peer_id)
        if current is not None and current.expires_at > record.expires_at:
            continue  # an older copy from a slower DHT node
        if record.state == PeerState.OFFLINE:
            merged.pop(record.peer_id, None)
        else:
            merged[record.peer_id] = record
    return {peer_id: r for peer_id, r in sorted(merged.items()) if r.expires_at > now}


def file_sd_groups(records: Iterable[PeerRecord], allowed_peers: Collection[str] = ()) -> list[dict]:
    """Prometheus file_sd target groups, one per (model, stage), sorted. Peers that announce no
    metrics address (or a malformed one) are left out, and so, in a private swarm (`allowed_peers`
    not empty), is every peer not on its list: anyone who can write to the DHT could otherwise make
    Prometheus scrape any address it names. Label names do not clash with the labels of the peers'
    own metrics (which carry `stage` themselves)."""
    allowed = frozenset(allowed_peers)
    groups: dict[tuple[str, int, int], set[str]] = {}
    for record in records:
        if record.metrics_addr is None or (allowed and record.peer_id not in allowed):
            continue
        try:
            target = parse_metrics_addr(record.metrics_addr)
        except ValueError as e:
            logger.warning(f"Peer {record.peer_id[-8:]} announces a bad metrics address: {e}")
            continue
        groups.setdefault((record.model, record.stage, record.num_stages), set()).add(target)
    return [
        {
            "targets": sorted(targets),
            "labels": {"swarm_model": model, "swarm_stage": str(stage), "swarm_num_stages": str(num_stages)},
        }
        for (model, stage, num_stages), targets in sorted(groups.items())
    ]


def render(groups: list[dict]) -> str:
    return json.dumps(groups, indent=2) + "\n"


# --- the loop ------------------------------------------------------------------------------------
class TargetsWriter:
    """Reads the model's stages from the DHT and rewrites the file when the target list changes."""

    def __init__(self, config: MonitorConfig, dht):
        self.config, self.dht = config, dht
        self.known: dict[str, PeerRecord] = {}
        self.written: str | None = None

    def stages_to_read(self, first: list[PeerRecord]) -> int:
        if self.config.num_stages is not None:
            return self.config.num_stages
        return max([r.num_stages for r in [*first, *self.known.values()]], default=1)

    async def refresh(self) -> bool:
        """One pass; returns whether the file was rewritten."""
        timeout_s = self.config.lookup_timeout_s
        first = await fetch_stage_records_async(self.dht, self.config.model, 0, timeout_s=timeout_s)
        rest = await asyncio.gather(
            *[
                fetch_stage_records_async(self.dht, self.config.model, s, timeout_s=timeout_s)
                for s in range(1, self.stages_to_read(first))
            ]
        )
        fresh = [record for records in [first, *rest] for record in records]
        self.known = merge_records(self.known, fresh, now=get_dht_time())
        text = render(file_sd_groups(self.known.values(), self.config.allowed_peers))
        if text == self.written:
            return False
        write_atomically(self.config.out, text)
        self.written = text
        count = sum(len(g["targets"]) for g in json.loads(text))
        print(f"wrote {count} targets of {self.config.model} to {self.config.out}", flush=True)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        while True:
            await self.refresh()
            if self.config.once:
                return
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.period_s)
                return
            except TimeoutError:
                pass


def run_monitor_targets(config: MonitorConfig) -> int:
    dht = start_dht(config, client_mode=True, models=[config.model])
    try:
        asyncio.run(_run_until_signalled(TargetsWriter(config, dht)))
    finally:
        dht.shutdown()
    return 0


async def _run_until_signalled(writer: TargetsWriter) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await writer.run(stop)
