"""The peer on the DHT: its record, the loop that keeps it fresh, the split claim it renews, and the
status file the container's health check reads.

`Announcer` reads what to announce from the `ServingState` (stage, state, throughput, load) each
time, so a move or a state change shows at the next announcement; moves and the standby loop call
`announce` at once when they change what the record says.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import hivemind
from hivemind.utils import get_dht_time

from dht.announce import announce
from dht.record_policy import MAX_RECORD_TTL_S
from dht.records import PeerRecord, PeerState, SplitRecord
from dht.split_agreement import publish_split_async
from models.identity import model_fingerprint
from peers.config import AnnounceSettings
from peers.health import write_status
from peers.metrics import UTILIZATION_WINDOW_S, PeerMetrics
from peers.placement.split_claim import renewed
from peers.serving.serving_state import ServingState
from process.version import software_version

RECENT_WRITES = 8  # how many of its last announcements' write times a peer's record lifetime follows


def record_ttl_s(configured_s: float, period_s: float, slowest_write_s: float) -> float:
    """How long an announced record lives. `configured_s` (three announcement periods) outlives two
    missed renewals while the DHT writes quickly. A slow write stretches both ends: renewals start at
    most max(period, slowest write) apart, and each lands up to one slowest write after it starts.
    The record then lives three such intervals plus one write, so that a loaded machine, where a
    write took 1-2.3 s against 1 s periods and 3 s records, does not make a live peer lapse."""
    stretched = 3 * max(period_s, slowest_write_s) + slowest_write_s
    return min(max(configured_s, stretched), MAX_RECORD_TTL_S)


class Announcer:
    def __init__(
        self,
        serving: ServingState,
        dht: hivemind.DHT,
        settings: AnnounceSettings,
        *,
        peer_id: str,
        model: str,
        averaging_mode: str,
        metrics: PeerMetrics,
        metrics_addr: str | None = None,
        split: SplitRecord | None = None,
        credential: str | None = None,
        run=None,
    ):
        self.credential = credential  # this peer's run credential: replicas read it to let us average with them
        self.following = run  # the run's spec (peers/serving/run_follower.py): its id and version are announced
        self.serving, self.dht, self.settings = serving, dht, settings
        self.peer_id, self.model, self.averaging_mode = peer_id, model, averaging_mode
        self.metrics, self.metrics_addr, self.split = metrics, metrics_addr, split
        self.write_seconds: deque[float] = deque(maxlen=RECENT_WRITES)  # the last announcements' writes

    @property
    def ttl_s(self) -> float:
        """The lifetime of the record announced next (`record_ttl_s`)."""
        slowest = max(self.write_seconds, default=0.0)
        return record_ttl_s(self.settings.record_ttl_s, self.settings.announce_period_s, slowest)

    def record(self, *, stage: int | None = None, state: PeerState | None = None) -> PeerRecord:
        """This peer's record; `stage`/`state` override what it serves now (a move announces both)."""
        serving = self.serving
        averaging = serving.averaging
        settings = averaging.settings_record() if hasattr(averaging, "settings_record") else None
        return PeerRecord(
            peer_id=self.peer_id,
            model=self.model,
            stage=serving.announced_stage if stage is None else stage,
            num_stages=serving.runtime.num_stages,
            state=state or serving.state,
            throughput=float(serving.runtime.throughput.value),
            load=float(serving.in_flight),
            version=software_version(),
            expires_at=get_dht_time() + self.ttl_s,
            averaging=averaging.mode if averaging is not None else self.averaging_mode,  # auto: as settled
            averaging_reason=getattr(averaging, "reason", "")[:400],
            outer=settings,
            gloo=averaging.gloo.address if getattr(averaging, "gloo", None) is not None else None,
            sync_exchange=getattr(averaging, "exchange", None) is not None,
            precision=serving.runtime.precision,
            weight_prediction=serving.runtime.weight_prediction,
            metrics_addr=self.metrics_addr,
            model_hash=model_fingerprint(serving.runtime.config),
            vocab_size=serving.runtime.config.vocab_size,
            credential=self.credential,
            steps_done=serving.runtime.steps_done,
            run_id=self.following.run_id if self.following is not None else "",
            spec_version=self.following.version if self.following is not None else 0,
            averaging_rounds=serving.averaging.rounds if serving.averaging is not None else 0,
            averaging_rounds_failed=serving.averaging.failed_rounds if serving.averaging is not None else 0,
            utilization=round(serving.compute_clock.utilization(UTILIZATION_WINDOW_S), 4),
        )

    async def announce(
        self, *, stage: int | None = None, state: PeerState | None = None, timeout_s: float = 10.0
    ) -> bool:
        """Store the record now; returns whether the DHT took it."""
        started = time.monotonic()
        stored = await announce(self.dht, self.record(stage=stage, state=state), timeout_s=timeout_s)
        self.write_seconds.append(time.monotonic() - started)
        return stored

    async def run(self, stop: asyncio.Event) -> None:
        """Re-announce every `announce_period_s`, from start to start (a slow write does not stretch
        the period), until `stop`; renew the split claim alongside."""
        next_s = time.monotonic()
        while not stop.is_set():
            stored = await self.announce()
            self.metrics.announcements.labels(result="ok" if stored else "failed").inc()
            if stored and self.serving.announced_online_at is None and self.serving.state == PeerState.ONLINE:
                self.serving.announced_online_at = time.monotonic()
            if self.split is not None:
                await publish_split_async(self.dht, renewed(self.split, active=True, ttl_s=self.ttl_s))
            self.report_status(stored)
            next_s = max(next_s + self.settings.announce_period_s, time.monotonic())
            try:
                await asyncio.wait_for(stop.wait(), timeout=next_s - time.monotonic())
            except TimeoutError:
                pass

    async def announce_final(self) -> None:
        """The last word on a clean exit, once the state says `offline`: trainers stop routing here at once."""
        self.report_status(await self.announce(timeout_s=5.0))

    async def release_split(self) -> None:
        """On a clean exit: our claim on the split no longer binds anyone."""
        if self.split is not None:
            await publish_split_async(
                self.dht, renewed(self.split, active=False, ttl_s=self.settings.record_ttl_s), timeout_s=5.0
            )

    def report_status(self, announced: bool) -> None:
        """With --status-file: what `python -m peers.health` (the container's HEALTHCHECK) reads."""
        if self.settings.status_file:
            write_status(
                self.settings.status_file,
                self.record(),
                announced=announced,
                ttl_s=self.ttl_s,
                requests_served=self.serving.requests_served,
                requests_failed=self.serving.requests_failed,
            )
