"""What each peer did for this trainer (issue #25): a pure ledger, fed by the calls to stages.

Per peer id: the samples it served (those of the backward calls it answered: the calls whose
gradients enter its optimizer step, on the last stage the fused forward+backward; each training
sample counts once per stage, so a stage's replicas' counts add up to the samples trained; the
recomputes of spot checks and validation passes are calls answered, not samples served), the calls
it answered and the calls that failed, the spot checks its answer took part in (`calls_verified`:
as the replica checked or as a checker), those in which its answer was not shown right
(`mismatches`: it disagreed with another answer and was in the minority, or nobody could tell who
was right), the samples of its own calls that checks found right (`samples_verified`), the checks
in which it and one other replica differed with no third to tell (`disputes`), the ban, if any,
with its reason, and how busy its compute was between its first answer to this trainer and its
latest (`utilization`, from the compute clock its answers carry, peers/compute/utilization.py: its
own word, shown, never routed on).

It is the trainer's own view: what a peer answered to *this* trainer, counted on this trainer's
clock. Nothing here is signed or published; a peer's count in another trainer's ledger differs.

Memory stays bounded: at most `max_peers` peers, the one not heard from for longest forgotten first
(a banned peer is kept over an unbanned one: a ban is what a report must not lose).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError


@dataclass
class PeerContribution:
    stage: int  # the stage it last served this trainer
    samples_served: int = 0
    calls_answered: int = 0
    calls_failed: int = 0
    calls_verified: int = 0
    mismatches: int = 0
    samples_verified: int = 0  # samples of its own calls a check found right: useful work shown
    disputes: int = 0  # checks where its answer and one other differed, with no third to tell
    banned: str | None = None  # why it was banned (the latest ban), None if never
    utilization: float | None = None  # its compute's busy fraction since its first answer (None: not known)


class ContributionLedger:
    """Counts per peer; every method is called from the trainer's event loop."""

    def __init__(self, *, max_peers: int = 4096):
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self.max_peers = max_peers
        self._peers: dict[str, PeerContribution] = {}  # least recently heard from first
        self._first_busy: dict[str, tuple[float, float]] = {}  # peer id -> its first compute clock reading

    def answered(self, peer_id: str, stage: int, rpc: str, samples: int) -> None:
        """`peer_id` answered a call of `samples` samples (served samples when it is a backward)."""
        entry = self._touch(peer_id, stage)
        entry.calls_answered += 1
        if rpc == "backward":
            entry.samples_served += samples

    def failed(self, peer_id: str, stage: int) -> None:
        """A call to `peer_id` failed (timeout, transport, refusal, garbage...)."""
        self._touch(peer_id, stage).calls_failed += 1

    def verified(
        self,
        stage: int,
        peers: Iterable[str],
        *,
        agreed: bool,
        majority: Iterable[str] = (),
        checked: str | None = None,
        samples: int = 0,
    ) -> None:
        """A spot check compared the answers of `peers`. When they did not all agree, those not in
        `majority` (the replicas whose answers agreed against a minority) count a mismatch. The
        `checked` replica (whose call of `samples` samples was checked) counts them as verified
        samples when its answer was right."""
        majority = set(majority)
        for peer_id in peers:
            entry = self._touch(peer_id, stage)
            entry.calls_verified += 1
            right = agreed or peer_id in majority
            if not right:
                entry.mismatches += 1
            if peer_id == checked and right:
                entry.samples_verified += samples

    def disputed(self, stage: int, peers: Iterable[str]) -> None:
        """Two replicas' answers to a check differed and no third could tell which was right (yet)."""
        for peer_id in peers:
            self._touch(peer_id, stage).disputes += 1

    def busy(self, peer_id: str, stage: int, reading: tuple[float, float] | None) -> None:
        """`peer_id`'s compute clock as an answer carried it: (busy seconds, clock seconds)."""
        if reading is None or peer_id not in self._peers:
            return
        first = self._first_busy.setdefault(peer_id, reading)
        if reading[1] < first[1]:  # its clock went back: the peer restarted; measure afresh
            first = self._first_busy[peer_id] = reading
        busy, elapsed = reading[0] - first[0], reading[1] - first[1]
        if elapsed > 0:
            self._touch(peer_id, stage).utilization = round(min(max(busy / elapsed, 0.0), 1.0), 4)

    def banned(self, peer_id: str, stage: int, reason: str) -> None:
        self._touch(peer_id, stage).banned = reason

    def get(self, peer_id: str) -> PeerContribution | None:
        return self._peers.get(peer_id)

    def check_records(self, peer_ids: Iterable[str]) -> dict[str, tuple[int, int]]:
        """peer id -> (mismatches, checks) of those of `peer_ids` checked so far."""
        return {p: (e.mismatches, e.calls_verified) for p in peer_ids if (e := self._peers.get(p)) is not None}

    def snapshot(self) -> dict[str, dict]:
        """peer id -> its counts (a copy, for the report and the metrics)."""
        return {peer_id: asdict(entry) for peer_id, entry in self._peers.items()}

    def merge(self, earlier: Mapping[str, Mapping]) -> dict[str, dict]:
        """This ledger's counts added to `earlier`'s (a resumed run's report): peer id -> counts."""
        merged = {peer_id: dict(counts) for peer_id, counts in earlier.items()}
        for peer_id, counts in self.snapshot().items():
            before = merged.get(peer_id)
            if before is None:
                merged[peer_id] = counts
                continue
            for key, value in counts.items():
                if isinstance(value, int) and key != "stage":
                    before[key] = int(before.get(key, 0)) + value
            before["stage"] = counts["stage"]
            before["banned"] = counts["banned"] or before.get("banned")
            if counts.get("utilization") is not None:
                before["utilization"] = counts["utilization"]
        return merged

    def _touch(self, peer_id: str, stage: int) -> PeerContribution:
        entry = self._peers.pop(peer_id, None) or PeerContribution(stage=stage)
        entry.stage = stage
        self._peers[peer_id] = entry  # last: heard from most recently
        while len(self._peers) > self.max_peers:
            others = [p for p in self._peers if p != peer_id]
            unbanned = next((p for p in others if self._peers[p].banned is None), None)
            forgotten = unbanned if unbanned is not None else others[0]
            del self._peers[forgotten]
            self._first_busy.pop(forgotten, None)
        return entry


class ReportedContribution(BaseModel):
    """One peer's counts as a trainer's JSON report states them (`contributions`), validated where
    a reader (`swarm status --report`) takes them in: the file may come from anyone."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    stage: int = Field(ge=0)
    samples_served: int = Field(ge=0)
    calls_answered: int = Field(ge=0)
    calls_failed: int = Field(ge=0)
    calls_verified: int = Field(ge=0)
    mismatches: int = Field(ge=0)
    samples_verified: int = Field(default=0, ge=0)  # absent from reports before issue #59
    disputes: int = Field(default=0, ge=0)
    banned: str | None = Field(default=None, max_length=1000)
    utilization: float | None = Field(default=None, ge=0.0, le=1.0)


class ReportError(ValueError):
    """A trainer report whose contributions cannot be read."""


def read_reported_contributions(path: str) -> dict[str, ReportedContribution]:
    """peer id -> its counts, from the trainer report at `path` (written by `swarm train --report`)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ReportError(f"cannot read the trainer report {path!r}: {e}") from None
    entries = data.get("contributions") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ReportError(
            f"{path!r} has no `contributions` map: is it a trainer's --report, written by this version or later?"
        )
    try:
        return {str(peer_id): ReportedContribution.model_validate(counts) for peer_id, counts in entries.items()}
    except ValidationError as e:
        raise ReportError(f"{path!r}: malformed contributions: {e}") from None
