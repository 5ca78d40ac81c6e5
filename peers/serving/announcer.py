"""The peer on the DHT: its record, the loop that keeps it fresh, the split claim it renews, and the
status file the container's health check reads.

`Announcer` reads what to announce from the `ServingState` (stage, state, throughput, load) each
time, so a move or a state change shows at the next announcement; moves and the standby loop call
`announce` at once when they change what the record says.
"""

from __future__ import annotations

import asyncio
import time

import hivemind
from hivemind.utils import get_dht_time

from dht.announce import announce
from dht.records import PeerRecord, PeerState, SplitRecord
from dht.split_agreement import publish_split_async
from models.identity import model_fingerprint
from peers.config import AnnounceSettings
from peers.health import write_status
from peers.metrics import PeerMetrics
from peers.placement.split_claim import renewed
from peers.serving.serving_state import ServingState
from process.version import software_version


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
    ):
        self.credential = credential  # this peer's run credential: replicas read it to let us average with them
        self.serving, self.dht, self.settings = serving, dht, settings
        self.peer_id, self.model, self.averaging_mode = peer_id, model, averaging_mode
        self.metrics, self.metrics_addr, self.split = metrics, metrics_addr, split

    def record(self, *, stage: int | None = None, state: PeerState | None = None) -> PeerRecord:
        """This peer's record; `stage`/`state` override what it serves now (a move announces both)."""
        serving = self.serving
        return PeerRecord(
            peer_id=self.peer_id,
            model=self.model,
            stage=serving.announced_stage if stage is None else stage,
            num_stages=serving.runtime.num_stages,
            state=state or serving.state,
            throughput=float(serving.runtime.throughput.value),
            load=float(serving.in_flight),
            version=software_version(),
            expires_at=get_dht_time() + self.settings.record_ttl_s,
            averaging=self.averaging_mode,
            precision=serving.runtime.precision,
            weight_prediction=serving.runtime.weight_prediction,
            metrics_addr=self.metrics_addr,
            model_hash=model_fingerprint(serving.runtime.config),
            vocab_size=serving.runtime.config.vocab_size,
            credential=self.credential,
            steps_done=serving.runtime.steps_done,
            averaging_rounds=serving.averaging.rounds if serving.averaging is not None else 0,
            averaging_rounds_failed=serving.averaging.failed_rounds if serving.averaging is not None else 0,
        )

    async def announce(
        self, *, stage: int | None = None, state: PeerState | None = None, timeout_s: float = 10.0
    ) -> bool:
        """Store the record now; returns whether the DHT took it."""
        return await announce(self.dht, self.record(stage=stage, state=state), timeout_s=timeout_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Re-announce every `announce_period_s` until `stop`; renew the split claim alongside."""
        while not stop.is_set():
            stored = await self.announce()
            self.metrics.announcements.labels(result="ok" if stored else "failed").inc()
            if stored and self.serving.announced_online_at is None and self.serving.state == PeerState.ONLINE:
                self.serving.announced_online_at = time.monotonic()
            if self.split is not None:
                await publish_split_async(self.dht, renewed(self.split, active=True, ttl_s=self.settings.record_ttl_s))
            self.report_status(stored)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.settings.announce_period_s)
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
                ttl_s=self.settings.record_ttl_s,
                requests_served=self.serving.requests_served,
                requests_failed=self.serving.requests_failed,
            )
