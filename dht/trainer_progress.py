"""Trainers' progress through the run's global step, shared on the DHT (`--data-shard I/N`, N > 1).

Several trainers feeding one swarm take its optimizer steps together: each trainer states, under
`progress_key(model)` (subkey: its own peer id, signed), the global step it works on, the samples
of that step whose backward has finished, and how many of them each replica served. A trainer
ends a step once the samples of every trainer on that step reach the run's batch
(swarm/trainer/global_step.py), in the spirit of hivemind's `ProgressTracker`. Records are
short-lived (a dead trainer's record expires) and validated where they are read.

A record only speaks for its signer and is capped where it is counted (at one batch), so a lying
trainer can end steps early, as it could by committing; in a run with an authority only trainers
with a credential commit at all.
"""

from __future__ import annotations

from typing import Any

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dht.keys import peer_subkey, progress_key
from dht.record_policy import CLOCK_SKEW_S, MAX_PROGRESS_TTL_S
from dht.signing import identity_of, owned_entries
from dht.subkey_records import await_store, lookup_async, misfiled_under, parse_entries, restamping_store

MAX_SERVED_ENTRIES = 1024  # (stage, replica) pairs one record may name


class TrainerProgress(BaseModel):
    """One trainer's samples toward one global step. Unknown fields are ignored; known ones are
    type-checked strictly."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=128)
    num_stages: int = Field(ge=1, le=1024)
    run: str = Field(min_length=1, max_length=64, description="the run's id, taken from the first trainer")
    step: int = Field(ge=0, description="the global step this trainer works on")
    samples: int = Field(ge=0, description="samples of that step whose backward finished")
    in_flight: int = Field(default=0, ge=0, description="samples of that step sent and not finished yet")
    published_at: float = Field(default=0.0, allow_inf_nan=False, description="DHT time the record was made")
    # "stage/peer id" -> samples that replica served this trainer in the step (the commit's weight caps)
    served: dict[str, int] = Field(default_factory=dict, max_length=MAX_SERVED_ENTRIES)
    expires_at: float = Field(allow_inf_nan=False, description="DHT time after which the record is stale")

    @model_validator(mode="after")
    def _served_names_stages(self) -> TrainerProgress:
        for key, samples in self.served.items():
            stage, _, peer = key.partition("/")
            if not (stage.isdigit() and int(stage) < self.num_stages and 1 <= len(peer) <= 128) or samples < 0:
                raise ValueError(f"served entry {key[:40]!r}: expected 'stage/peer id' -> samples >= 0")
        return self

    def served_by_stage(self) -> dict[int, dict[str, int]]:
        by_stage: dict[int, dict[str, int]] = {}
        for key, samples in self.served.items():
            stage, _, peer = key.partition("/")
            by_stage.setdefault(int(stage), {})[peer] = samples
        return by_stage

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: Any) -> TrainerProgress:
        """Parse a DHT value; raises `ValueError` for anything malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a progress record must be a mapping, got {type(value).__name__}")
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise ValueError(f"malformed progress record: {where + ': ' if where else ''}{error['msg']}") from None


def served_key(stage: int, peer_id: str) -> str:
    return f"{stage}/{peer_id}"


def parse_progress_records(entries: dict[Any, Any], *, model: str, now: float) -> list[TrainerProgress]:
    """Every well-formed, unexpired progress record of `model`; the rest is skipped with a warning."""
    misfiled = misfiled_under(model)

    def misplaced(subkey, record: TrainerProgress) -> str | None:
        reason = misfiled(subkey, record)
        if reason is None and record.expires_at > now + MAX_PROGRESS_TTL_S + CLOCK_SKEW_S:
            return f"it expires in {record.expires_at - now:.0f} s, more than {MAX_PROGRESS_TTL_S:.0f} s"
        return reason

    records = parse_entries(entries, TrainerProgress.from_wire, misplaced, kind="progress record", where=model)
    return [r for r in records if r.expires_at >= now]


# --- DHT I/O -------------------------------------------------------------------------------------


async def publish_progress_async(dht: hivemind.DHT, record: TrainerProgress, *, timeout_s: float = 5.0) -> bool:
    """Store `record` for the lifetime its `expires_at` gives it. Returns whether it was stored."""
    subkey = peer_subkey(record.peer_id, identity_of(dht).owner_marker)
    store = restamping_store(dht, progress_key(record.model), subkey, record)

    return await await_store(store, timeout_s=timeout_s, what=f"Publishing the progress of step {record.step}")


async def fetch_progress_async(dht: hivemind.DHT, model: str, *, timeout_s: float = 5.0) -> list[TrainerProgress]:
    """Every trainer's unexpired progress record; [] (with a warning) when the lookup times out."""
    entries = await lookup_async(dht, progress_key(model), timeout_s=timeout_s, what=f"the progress of {model}")
    owned = owned_entries(entries or {}, what=f"{model} progress records", allowed=None)
    return parse_progress_records(owned, model=model, now=get_dht_time())
