"""Is this peer serving? Asked of the peer itself, cheaply enough for a container's HEALTHCHECK.

With `--status-file`, the peer writes a small JSON status after every announcement on the DHT
(atomically). `python -m peers.health` reads that file and exits 0 only when the peer is online, its
last announcement was stored, and the file is fresh (written within the record's time-to-live, so a
hung event loop or a dead announcer turns the check red). It imports neither torch nor hivemind,
so a check takes a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dht.records import PeerRecord, PeerState
from process.atomic_files import write_atomically
from process.config import ConfigError, add_config_arguments, from_sources, option

logger = logging.getLogger(__name__)

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1  # Docker reserves exit code 2 of a HEALTHCHECK


class PeerStatus(BaseModel):
    """What the peer last said about itself, in the status file. Times are Unix seconds."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer_id: str
    model: str
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    state: PeerState
    announced: bool  # whether the last announcement was stored on the DHT
    requests_served: int = Field(ge=0)
    requests_failed: int = Field(ge=0)
    written_at: float
    fresh_until: float  # after this, the peer has missed several announcements


class HealthError(RuntimeError):
    """The status file is missing or unreadable."""


def write_status(
    path: str, record: PeerRecord, *, announced: bool, ttl_s: float, requests_served: int, requests_failed: int
) -> bool:
    """Write the status atomically. Never raises for I/O: a full disk must not stop the announcer."""
    now = time.time()
    status = PeerStatus(
        peer_id=record.peer_id,
        model=record.model,
        stage=record.stage,
        num_stages=record.num_stages,
        state=record.state,
        announced=announced,
        requests_served=requests_served,
        requests_failed=requests_failed,
        written_at=now,
        fresh_until=now + ttl_s,
    )
    try:
        write_atomically(path, status.model_dump_json())
        return True
    except OSError as e:
        logger.warning(f"Could not write the status file {path!r}: {e}")
        return False


def read_status(path: str) -> PeerStatus:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise HealthError(f"no status at {path!r} ({e.strerror}): the peer has not announced itself yet") from None
    try:
        return PeerStatus.model_validate_json(text, strict=False)  # JSON has no enums: accept "online"
    except ValidationError as e:
        raise HealthError(f"malformed status file {path!r}: {e.errors()[0]['msg']}") from None


def problem(status: PeerStatus, now: float) -> str | None:
    """Why this peer is not serving, or None when it is."""
    if status.state not in (PeerState.ONLINE, PeerState.STANDBY):  # a standby is healthy while it waits
        return f"the peer is {status.state.value}"
    if now > status.fresh_until:
        return f"the last announcement was {now - status.written_at:.0f} s ago: the peer stopped announcing"
    if not status.announced:
        return "the last announcement was not stored on the DHT (are the initial peers reachable?)"
    return None


@dataclasses.dataclass(kw_only=True)
class HealthConfig:
    status_file: str | None = option(None, help="the status file the peer writes (its --status-file)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m peers.health", description="Exit 0 if the peer that writes the status file is serving."
    )
    add_config_arguments(parser, HealthConfig)
    try:
        config = from_sources(HealthConfig, parser.parse_args(argv))
        if not config.status_file:
            raise ConfigError("--status-file (or SWARM_STATUS_FILE) is required")
        status = read_status(config.status_file)
    except (ConfigError, HealthError) as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return EXIT_UNHEALTHY
    reason = problem(status, time.time())
    where = f"{status.model} stage {status.stage}/{status.num_stages}, peer …{status.peer_id[-12:]}"
    if reason is not None:
        print(f"unhealthy: {reason} ({where})", file=sys.stderr)
        return EXIT_UNHEALTHY
    print(f"healthy: serving {where}, {status.requests_served} requests served, {status.requests_failed} failed")
    return EXIT_HEALTHY


if __name__ == "__main__":
    sys.exit(main())
