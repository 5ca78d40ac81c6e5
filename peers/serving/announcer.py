"""The peer on the DHT: its record, the loop that keeps it fresh, the split claim it renews, and the
status file the container's health check reads.

`Announcer` reads what to announce from the `ServingState` (stage, state, throughput, load) each
time, so a move or a state change shows at the next announcement; moves and the standby loop call
`announce` at once when they change what the record says. The record carries the steps done and
the step rate since the announcement before, and is renewed early when the steps move on, so that
others can tell how far it may be by now (what bounds a state donor's step count,
peers/replicas/donor_choice.py).
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
MIN_RATE_INTERVAL_S = 1.0  # the step rate is counted over at least this long (a move announces at once)
PROMPT_STEPS = 8  # announce early once this many steps were taken (half of a donor's STEP_SLACK)


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
        self.steps_per_s = 0.0  # over the interval before the last announcement
        self._counted: tuple[float, int] | None = None  # (monotonic time, steps done) the rate is counted from
        self.announced_steps = 0  # the steps in the last record announced

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
            steps_per_s=self.steps_per_s,
            announced_at=get_dht_time(),
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
        self._count_steps(started)
        record = self.record(stage=stage, state=state)
        self.announced_steps = record.steps_done
        stored = await announce(self.dht, record, timeout_s=timeout_s)
        self.write_seconds.append(time.monotonic() - started)
        return stored

    def _count_steps(self, now: float) -> None:
        steps = self.serving.runtime.steps_done
        if self._counted is not None and now - self._counted[0] >= MIN_RATE_INTERVAL_S:
            self.steps_per_s = round(max(0, steps - self._counted[1]) / (now - self._counted[0]), 3)
        if self._counted is None or now - self._counted[0] >= MIN_RATE_INTERVAL_S:
            self._counted = (now, steps)

    async def run(self, stop: asyncio.Event) -> None:
        """Re-announce every `announce_period_s`, from start to start (a slow write does not stretch
        the period), and sooner once `PROMPT_STEPS` steps were taken since, until `stop`; renew the
        split claim alongside."""
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
            while not stop.is_set() and time.monotonic() < next_s:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=min(MIN_RATE_INTERVAL_S, next_s - time.monotonic()))
                except TimeoutError:
                    pass
                if self.serving.runtime.steps_done - self.announced_steps >= PROMPT_STEPS:
                    next_s = time.monotonic()  # the steps moved on: announce now, the period starts again
                    break

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
