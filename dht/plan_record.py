"""The placement plan on the DHT: which peers serve which stage, as `swarm plan --publish` decided.

`swarm plan --from-dht --publish` stores a `PlanRecord` under `plan_key(model)`, subkey the
planner's peer id, with an expiry. The current plan is the newest unexpired valid one
(`current_plan`, pure). A peer that follows plans (`--stage auto`) asks `stage_in_plan(plan, its id)`:
a stage index, or None when the plan does not place it (a spare, or a peer that joined later).
"""

from __future__ import annotations

import math
from typing import Any

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dht.keys import peer_subkey, plan_key
from dht.record_policy import CLOCK_SKEW_S, MAX_PLAN_TTL_S
from dht.signing import identity_of, owned_entries, plan_signers_of
from dht.subkey_records import await_store, lookup, lookup_async, parse_entries, restamping_store, wait_store

MAX_PLAN_PEERS = 1024


class PlanRecord(BaseModel):
    """A plan: `stages[i]` lists the peer ids that serve pipeline stage i (in pipeline order);
    `spares` were measured but left out (the peers did not divide evenly into the stages)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(min_length=1, max_length=128)
    num_stages: int = Field(ge=1, le=1024)
    stages: tuple[tuple[str, ...], ...] = Field(min_length=1, max_length=1024)
    spares: tuple[str, ...] = Field(default=(), max_length=MAX_PLAN_PEERS)
    total_s: float = Field(ge=0.0, allow_inf_nan=False, description="the plan's DT-FM cost, seconds")
    data_parallel_s: float = Field(ge=0.0, allow_inf_nan=False)
    pipeline_s: float = Field(ge=0.0, allow_inf_nan=False)
    planner_id: str = Field(min_length=1, max_length=128, description="peer id of the process that planned")
    created_at: float = Field(allow_inf_nan=False, description="DHT time the plan was made; the newest wins")
    expires_at: float = Field(allow_inf_nan=False)

    @model_validator(mode="after")
    def _every_peer_in_one_place(self) -> PlanRecord:
        if len(self.stages) != self.num_stages:
            raise ValueError(f"num_stages is {self.num_stages} but the plan lists {len(self.stages)} stages")
        if any(not group for group in self.stages):
            raise ValueError("every stage needs at least one peer")
        placed = [peer for group in self.stages for peer in group] + list(self.spares)
        if len(placed) > MAX_PLAN_PEERS:
            raise ValueError(f"a plan names at most {MAX_PLAN_PEERS} peers, this one {len(placed)}")
        if any(not 1 <= len(peer) <= 128 for peer in placed):
            raise ValueError("peer ids must have 1 to 128 characters")
        if len(set(placed)) != len(placed):
            raise ValueError("a peer appears twice in the plan")
        if not math.isclose(self.total_s, self.data_parallel_s + self.pipeline_s, rel_tol=1e-6, abs_tol=1e-9):
            raise ValueError("total_s is not data_parallel_s + pipeline_s")
        return self

    @property
    def peer_ids(self) -> tuple[str, ...]:
        """Every peer the plan places on a stage (spares excluded)."""
        return tuple(peer for group in self.stages for peer in group)

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: Any) -> PlanRecord:
        """Parse a DHT value; raises `ValueError` for anything malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a plan record must be a mapping, got {type(value).__name__}")
        stages, spares = value.get("stages"), value.get("spares", ())
        if isinstance(stages, list):
            stages = tuple(tuple(group) if isinstance(group, list) else group for group in stages)
        if isinstance(spares, list):
            spares = tuple(spares)
        try:
            return cls.model_validate({**value, "stages": stages, "spares": spares})
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise ValueError(f"malformed plan record: {where + ': ' if where else ''}{error['msg']}") from None


def stage_in_plan(plan: PlanRecord | None, peer_id: str) -> int | None:
    """The stage `plan` gives `peer_id`, or None if it places that peer nowhere (or there is no plan)."""
    if plan is None:
        return None
    for stage, group in enumerate(plan.stages):
        if peer_id in group:
            return stage
    return None


def current_plan(entries: dict[Any, Any], *, model: str, now: float) -> PlanRecord | None:
    """The newest (by `created_at`, then planner id) valid, unexpired plan of `model` among DHT
    entries {subkey: value}; malformed entries, ones whose subkey is not their planner, and ones
    made in the future or expiring too late (beyond `CLOCK_SKEW_S`: such a plan would stay the
    newest for good) are logged and skipped."""

    def misplaced(subkey, plan: PlanRecord) -> str | None:
        if plan.planner_id != subkey or plan.model != model:
            return f"it names planner {plan.planner_id}, model {plan.model}"
        if plan.created_at > now + CLOCK_SKEW_S:
            return f"it was made {plan.created_at - now:.0f} s in the future"
        if plan.expires_at > now + MAX_PLAN_TTL_S + CLOCK_SKEW_S:
            return f"it expires in {plan.expires_at - now:.0f} s, more than {MAX_PLAN_TTL_S:.0f} s"
        return None

    plans = [
        plan
        for plan in parse_entries(entries, PlanRecord.from_wire, misplaced, kind="plan record", where=model)
        if plan.expires_at > now
    ]
    return max(plans, key=lambda p: (p.created_at, p.planner_id), default=None)


# --- DHT I/O -------------------------------------------------------------------------------------


def _store(dht: hivemind.DHT, plan: PlanRecord):
    return restamping_store(
        dht, plan_key(plan.model), peer_subkey(plan.planner_id, identity_of(dht).owner_marker), plan
    )


def publish_plan(dht: hivemind.DHT, plan: PlanRecord, *, timeout_s: float = 10.0) -> bool:
    """Store `plan` (blocking). Returns whether it was stored."""
    return wait_store(_store(dht, plan), timeout_s=timeout_s, what=f"Publishing the plan of {plan.model}")


async def publish_plan_async(dht: hivemind.DHT, plan: PlanRecord, *, timeout_s: float = 10.0) -> bool:
    return await await_store(_store(dht, plan), timeout_s=timeout_s, what=f"Publishing the plan of {plan.model}")


def _current(dht: hivemind.DHT, entries: dict, model: str) -> PlanRecord | None:
    # signed by the peer they name, one of the run's plan signers where it names them
    entries = owned_entries(entries, what=f"{model} plans", allowed=plan_signers_of(dht))
    return current_plan(entries, model=model, now=get_dht_time())


def fetch_plan(dht: hivemind.DHT, model: str, *, timeout_s: float = 10.0) -> PlanRecord | None:
    """The current plan of `model`, or None (blocking; raises TimeoutError if the DHT does not answer)."""
    return _current(dht, lookup(dht, plan_key(model), timeout_s=timeout_s), model)


async def fetch_plan_async(dht: hivemind.DHT, model: str, *, timeout_s: float = 10.0) -> PlanRecord | None:
    """The current plan of `model`, or None (also when the lookup times out, with a warning)."""
    entries = await lookup_async(dht, plan_key(model), timeout_s=timeout_s, what=f"the plan of {model}")
    return None if entries is None else _current(dht, entries, model)
