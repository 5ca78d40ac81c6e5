"""One global step for several trainers on one run (`--data-shard I/N` with N > 1).

Each trainer streams its own microbatches into the swarm and states on the DHT how many samples of
the current global step it has finished (dht/trainer_progress.py). The step is over for everyone
once the samples of all trainers on it reach the run's batch (`--batch-size`), or once any trainer
has moved past it; then every trainer commits the step under one id that all of them share
(`step_id`), and the replicas, which answer a repeated commit with the outcome of the first,
average and step once. So two trainers make the run's steps twice as fast, not twice as many.

What a trainer killed mid-step had finished stays counted (its gradients are on the replicas); what
it had in flight is lost with it, as with one trainer. Microbatches that finish after the step was
committed are accumulated by the replicas into the next step. The commit's weight caps are every
trainer's count of what each replica served in the step, as last seen on the DHT.

The decisions (`step_status`, `merged_served`, `joining_point`) are pure; `SharedProgress` does the
DHT reads and writes, on the trainer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import hivemind
from hivemind.utils import get_dht_time

from dht.trainer_progress import TrainerProgress, fetch_progress_async, publish_progress_async, served_key

logger = logging.getLogger(__name__)

PROGRESS_TTL_S = 60.0  # a trainer that stops renewing its record drops out of the count after this
REFRESH_S = 0.25  # how often a trainer reads the others' progress while it waits for the step to end


CLAIM_S = 5.0  # another trainer's samples in flight count as claimed while its record is this fresh
HEARTBEAT_S = 1.0  # how often a trainer renews its record while it has samples in flight


@dataclass(frozen=True)
class StepStatus:
    samples: int  # samples counted toward the step: this trainer's and the others' (each at most a batch)
    over: bool  # the step is complete: counted >= the batch, or another trainer is past it


def others_on_run(records: list[TrainerProgress], me: str, run: str) -> list[TrainerProgress]:
    return [r for r in records if r.peer_id != me and r.run == run]


def step_status(step: int, own_samples: int, others: list[TrainerProgress], batch: int) -> StepStatus:
    """Where global step `step` stands, from this trainer's finished samples and the others' records."""
    counted = own_samples + sum(min(r.samples, batch) for r in others if r.step == step)
    moved_on = any(r.step > step for r in others)
    return StepStatus(samples=counted, over=moved_on or counted >= batch)


def may_send(
    step: int, own_samples: int, own_in_flight: int, others: list[TrainerProgress], batch: int, now: float
) -> bool:
    """Whether this trainer sends another microbatch of `step`: the samples finished and in flight
    (ours, and the others' as their fresh records claim them) fall short of the batch, and ours in
    flight are under our share of it (the batch over the trainers at work), so that trainers that
    start a step together split it instead of each sending all of it. A trainer whose fresh record
    is still on an earlier step (its record of this one is not stored yet) claims its share, so that
    the first to reach a step does not fill the batch on a view that cannot show the other sending.
    Our share we may always send, whatever the others claim: a claim that is never finished (a
    forged record, renewed) cannot stall the step, and costs at most a share more samples in it."""
    fresh = [r for r in others if now - r.published_at <= CLAIM_S]
    trainers = 1 + len(fresh)
    share = -(-batch // trainers)
    on_step = [r for r in others if r.step == step]
    claimed = sum(min(r.samples, batch) for r in on_step)
    claimed += sum(min(r.in_flight, batch) for r in on_step if now - r.published_at <= CLAIM_S)
    claimed += share * sum(1 for r in fresh if r.step < step)
    ours = own_samples + own_in_flight
    return own_in_flight < share and (ours + claimed < batch or ours < share)


def merged_served(
    step: int, own: dict[int, dict[str, int]], others: list[TrainerProgress]
) -> dict[int, dict[str, int]]:
    """What each replica served in `step`, summed over this trainer and the others on the step: the
    commit's weight caps."""
    merged = {stage: dict(by_peer) for stage, by_peer in own.items()}
    for record in others:
        if record.step != step:
            continue
        for stage, by_peer in record.served_by_stage().items():
            into = merged.setdefault(stage, {})
            for peer, samples in by_peer.items():
                into[peer] = into.get(peer, 0) + samples
    return merged


def joining_point(records: list[TrainerProgress], me: str) -> tuple[str, int] | None:
    """The run and global step a starting trainer joins: those of the trainers already at work (the
    furthest step of the run that the lowest peer id is on, so that all joiners pick the same run),
    or None when no other trainer is."""
    others = sorted((r for r in records if r.peer_id != me), key=lambda r: r.peer_id)
    if not others:
        return None
    run = others[0].run
    return run, max(r.step for r in others if r.run == run)


def run_to_adopt(records: list[TrainerProgress], me: str, run: str) -> str | None:
    """Two trainers that start at once may each start a run; the run named by the lowest peer id
    among them wins, and the other adopts it (its step number stays: both are at their first)."""
    lower = sorted((r for r in records if r.peer_id < me and r.run != run), key=lambda r: r.peer_id)
    return lower[0].run if lower else None


def step_id(run: str, step: int) -> str:
    """The commit id every trainer of the run uses for `step` (the replicas step once per id)."""
    return f"{run}:global:{step}"


class SharedProgress:
    """This trainer's side of the global step: publishes its progress, reads the others'."""

    def __init__(self, dht: hivemind.DHT, *, model: str, num_stages: int, batch: int, peer_id: str):
        self.dht, self.model, self.num_stages, self.batch, self.peer_id = dht, model, num_stages, batch, peer_id
        self.run = secrets.token_hex(6)
        self.others: list[TrainerProgress] = []
        self._read_at = 0.0
        self._publishing: asyncio.Task | None = None  # `publish_soon`'s store under way
        self._changed_since = False  # ... and the record changed meanwhile
        self.begin(0)

    async def join(self, at_least: int = 0) -> int:
        """Take the run and step of the trainers already at work (or start a run); returns the step."""
        records = await fetch_progress_async(self.dht, self.model)
        point = joining_point(records, self.peer_id)
        if point is not None:
            self.run, step = point
            self.begin(max(step, at_least))
        else:
            self.begin(at_least)
        self.others = others_on_run(records, self.peer_id, self.run)
        await self.publish()
        return self.step

    def begin(self, step: int) -> None:
        self.step, self.samples, self.in_flight = step, 0, 0
        self.served: dict[int, dict[str, int]] = {}
        self._published_at = 0.0

    def may_send(self) -> bool:
        return may_send(self.step, self.samples, self.in_flight, self.others, self.batch, get_dht_time())

    def sent(self, samples: int) -> None:
        self.in_flight += samples

    def note(self, samples: int, served: dict[int, dict[str, int]]) -> None:
        """This trainer finished `samples` more samples of the step; `served`: its counts so far, by stage."""
        self.samples += samples
        self.in_flight -= samples
        self.served = {stage: dict(by_peer) for stage, by_peer in served.items()}

    def status(self) -> StepStatus:
        return step_status(self.step, self.samples, self.others, self.batch)

    def caps(self) -> dict[int, dict[str, int]]:
        return merged_served(self.step, self.served, self.others)

    def record(self) -> TrainerProgress:
        served = {served_key(stage, peer): n for stage, by_peer in self.served.items() for peer, n in by_peer.items()}
        return TrainerProgress(
            peer_id=self.peer_id,
            model=self.model,
            num_stages=self.num_stages,
            run=self.run,
            step=self.step,
            samples=self.samples,
            in_flight=self.in_flight,
            served=served,
            published_at=get_dht_time(),
            expires_at=get_dht_time() + PROGRESS_TTL_S,
        )

    async def publish(self, *, unless_within_s: float = 0.0) -> None:
        """Store our record (unless one was stored less than `unless_within_s` ago)."""
        if time.monotonic() - self._published_at < unless_within_s:
            return
        self._published_at = time.monotonic()
        if not await publish_progress_async(self.dht, self.record()):
            logger.warning(f"could not publish this trainer's progress of step {self.step}")

    def publish_soon(self, *, unless_within_s: float = 0.0) -> None:
        """`publish` in the background: a store takes tens of milliseconds, which the trainer's loop
        spends streaming microbatches instead. A record that changes while one is under way is
        stored again once it is done; stores of one record never overlap (a record that arrives
        late loses to a later one anyway: the DHT keeps the latest expiry)."""
        if time.monotonic() - self._published_at < unless_within_s:
            return
        if self._publishing is not None and not self._publishing.done():
            self._changed_since = True
            return
        self._publishing = asyncio.ensure_future(self._publish_until_current())

    async def _publish_until_current(self) -> None:
        while True:
            self._changed_since = False
            await self.publish()
            if not self._changed_since:
                return

    async def published(self) -> None:
        """Once no `publish_soon` store is under way (before the final `publish` of a step)."""
        if self._publishing is not None:
            await self._publishing

    async def refresh(self, *, every_s: float = REFRESH_S) -> None:
        """Read the others' progress, at most every `every_s`."""
        if time.monotonic() - self._read_at < every_s:
            return
        self._read_at = time.monotonic()
        records = await fetch_progress_async(self.dht, self.model)
        adopted = run_to_adopt(records, self.peer_id, self.run)
        if adopted is not None:
            logger.info(f"another trainer started run {adopted} at the same time; joining it")
            self.run = adopted
        self.others = others_on_run(records, self.peer_id, self.run)
