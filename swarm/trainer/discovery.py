"""The swarm as the trainer sees it: which replicas serve each stage, read from the DHT.

`SwarmView` holds, per stage, the online peers' records, the `ReplicaScheduler` that routes
calls among them (swarm/trainer/routing.py) and the `NewcomerCap` on peers first seen lately
(swarm/trainer/newcomers.py), and the `BanList` of peers to avoid for a while and the
`ProtocolViolations` of peers to avoid for long (swarm/trainer/failures.py). `refresh()` re-reads the records and feeds the schedulers; calls
(stage_call.py) choose replicas from it and report back to it. The functions below it find what a
run starts from: the number of stages, the split the peers serve, a replica on every stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

import hivemind

from dht.announce import fetch_stage_records_async
from dht.authority import RunAuthority, credentialed_records
from dht.model_match import (
    check_same_model,
    check_same_vocabulary,
    describe_foreign,
    foreign_records,
    judging_records,
)
from dht.records import PeerRecord, PeerState
from dht.split_agreement import SplitConflictError, fetch_split_records_async, split_in_force
from swarm.trainer.failures import BanList, ProtocolViolations
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.newcomers import NewcomerCap
from swarm.trainer.routing import ReplicaInfo, ReplicaScheduler

logger = logging.getLogger(__name__)


class DiscoveryError(RuntimeError):
    """No usable peers of the model were found."""


class SwarmView:
    def __init__(
        self,
        dht: hivemind.DHT | None,
        *,
        model: str,
        num_stages: int,
        say=print,
        metrics: TrainerMetrics | None = None,
        model_hash: str = "",
        authority: RunAuthority | None = None,
    ):
        self.dht, self.model, self.num_stages = dht, model, num_stages
        # a private run (dht/authority.py): only peers whose records carry a peer credential are routed to
        self.authority = authority if authority is not None and authority.private else None
        self.run_authority = authority  # open or private: who may average (see `averaging_members`)
        self.model_hash = model_hash  # records of another model (another hash) are never routed to
        self.foreign: list[PeerRecord] = []
        self.foreign_peers: set[str] = set()  # peers whose records announced another model, skipped
        self.seen: list[PeerRecord] = []
        self.schedulers = [ReplicaScheduler() for _ in range(num_stages)]
        # A short base ban: a replica refused at once (killed, or a dropped stream) is cheap to probe
        # again, and a stage whose only replica had a glitch must not stall for 15 s; a call that failed
        # slowly (a timeout) is banned at least 3x as long as it took (see StageCaller).
        self.bans = BanList(base_s=1.0, max_s=60.0)
        # Peers that broke the protocol (a wrong-stage or malformed answer) are avoided for long, and
        # peers first seen lately take a bounded share of their stage's calls (issue #30).
        self.violations = ProtocolViolations()
        self.newcomers = [NewcomerCap() for _ in range(num_stages)]
        self.records: list[list[PeerRecord]] = [[] for _ in range(num_stages)]
        self.refreshes = 0
        self._say = say
        self.metrics = metrics or TrainerMetrics()

    async def refresh(self) -> None:
        """Re-read every stage's records; say which replicas joined or left since the last time."""
        results = await asyncio.gather(
            *[fetch_stage_records_async(self.dht, self.model, s) for s in range(self.num_stages)]
        )
        self.seen = [r for records in results for r in records]  # every record, before any filter
        self.foreign = foreign_records(self.seen, self.model_hash)
        newly_foreign = [r for r in self.foreign if r.peer_id not in self.foreign_peers]
        if newly_foreign:  # never routed to; said once per peer (dht/model_match.py)
            self.foreign_peers |= {r.peer_id for r in newly_foreign}
            logger.warning(describe_foreign(newly_foreign))
        for stage, records in enumerate(results):
            online = [r for r in records if r.state == PeerState.ONLINE and r.num_stages == self.num_stages]
            if self.authority is not None:
                online = credentialed_records(online, self.authority, stage=stage)
            online = [r for r in online if r not in self.foreign]
            known, now = {r.peer_id for r in self.records[stage]}, {r.peer_id for r in online}
            if self.refreshes and known != now:  # not on the first refresh: that is the start
                joined, left = sorted(p[-8:] for p in now - known), sorted(p[-8:] for p in known - now)
                self._say(
                    f"stage {stage}: {len(now)} replicas"
                    + (f"; joined {', '.join(joined)}" if joined else "")
                    + (f"; left {', '.join(left)}" if left else "")
                )
            self.records[stage] = online
            self.newcomers[stage].saw(r.peer_id for r in online)
            self.schedulers[stage].update_replicas([ReplicaInfo(r.peer_id, r.throughput) for r in online])
        self.metrics.set_stages(self.live_replicas(), [sum(r.throughput for r in rs) for rs in self.records])
        self.refreshes += 1

    def others_usable(self, stage: int, peer_id: str) -> bool:
        """Whether `stage` has a replica besides `peer_id` that is not banned now: a replica is banned
        for long for stalling only then (the only replica of a stage, slow under load, is not)."""
        others = set(self.schedulers[stage].keys_s()) - {peer_id}
        return bool(others - self.bans.banned() - self.violations.banned(stage))

    def split_claimants(self) -> set[str] | None:
        """The peers whose split claims count: in a run, those whose records judge this trainer's
        model (dht/model_match.py); None without a run (every peer's)."""
        if self.run_authority is None:
            return None
        return {r.peer_id for r in judging_records(self.seen, self.run_authority, credentialed=True)}

    def averaging_members(self, stage: int) -> frozenset[str] | None:
        """The replicas of `stage` that may average with each other: those whose record carries a peer
        credential of the run (an open run lets others serve, but their replicas refuse them in
        averaging); None without a run authority (everyone averages)."""
        if self.run_authority is None:
            return None
        return frozenset(r.peer_id for r in credentialed_records(self.records[stage], self.run_authority, stage=stage))

    async def refresh_forever(self, period_s: float) -> None:
        """Refresh every `period_s` seconds from start to start, so that a slow DHT lookup (a loaded
        machine) does not stretch the period in which a new peer is discovered."""
        next_s = time.monotonic() + period_s
        while True:
            await asyncio.sleep(max(next_s - time.monotonic(), 0.0))
            next_s = max(next_s + period_s, time.monotonic())
            try:
                await self.refresh()
            except Exception as e:  # the DHT may hiccup; the next refresh tries again
                logger.warning(f"Refreshing the peer list failed: {e}")

    def live_replicas(self) -> list[int]:
        return [len(records) for records in self.records]


async def discover_num_stages(dht: hivemind.DHT, model: str, timeout_s: float, say=print) -> int:
    """The number of stages the peers of stage 0 serve (the largest, if they disagree)."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while time.monotonic() < deadline:
        records = [r for r in await fetch_stage_records_async(dht, model, 0) if r.state == PeerState.ONLINE]
        if records:
            counts = sorted({r.num_stages for r in records})
            if len(counts) > 1:
                say(
                    f"peers of {model} disagree on the number of stages {counts}; using {counts[-1]} (pass --num-stages)"
                )
            return counts[-1]
        if not announced:
            say(f"waiting for peers of {model} to appear on the DHT...")
            announced = True
        await asyncio.sleep(1.0)
    raise DiscoveryError(f"no peer serving {model} stage 0 appeared within {timeout_s:.0f} s")


async def read_split(
    dht: hivemind.DHT, model: str, num_stages: int, claimants: Collection[str] | None = None
) -> list[int] | None:
    """The split the peers serve; a `DiscoveryError` if they disagree or it has another number of
    stages. `claimants`: the peers whose claims count (a run's members); None: every peer's."""
    records = await fetch_split_records_async(dht, model)
    if claimants is not None:
        records = [r for r in records if r.peer_id in claimants]
    try:
        split = split_in_force(records)
    except SplitConflictError as e:
        raise DiscoveryError(str(e)) from None
    if split is not None and split.num_stages != num_stages:
        raise DiscoveryError(f"the peers serve {model} in {split.describe()}, not in {num_stages} stages")
    return list(split.boundaries) if split is not None else None


async def wait_for_every_stage(
    view: SwarmView, timeout_s: float, *, vocab_size: int | None = None, vocab_source: str = "data"
) -> None:
    """Refresh until every stage has an online replica; a `DiscoveryError` after `timeout_s`, a
    `ModelMismatchError` at once when the live peers of the name serve another model and none this
    one (a `VocabularyMismatchError`, naming both sizes, when it is the vocabulary that differs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await view.refresh()
        # refused only as the odd one out; a stranger's record of another model is skipped (refresh)
        judged_by = dict(authority=view.run_authority, credentialed=view.run_authority is not None)
        if vocab_size is not None:
            check_same_vocabulary(
                view.seen, vocab_size, model=view.model, who="trainer", mine=vocab_source, **judged_by
            )
        check_same_model(view.seen, view.model_hash, model=view.model, who="trainer", **judged_by)
        counts = view.live_replicas()
        if all(counts):
            return
        if time.monotonic() > deadline:
            missing = [s for s, n in enumerate(counts) if not n]
            raise DiscoveryError(f"stages {missing} have no online peer after {timeout_s:.0f} s")
        await asyncio.sleep(1.0)
