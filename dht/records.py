"""The typed records peers state on the DHT (announcements, the split, move claims), validated where read."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dht.subkey_records import misfiled_under, parse_entries

PROTOCOL_VERSION = 1


class PeerState(str, Enum):
    JOINING = "joining"  # loading state, not serving yet
    ONLINE = "online"  # serving requests
    OFFLINE = "offline"  # left cleanly; route nothing here
    STANDBY = "standby"  # backup pool: holds a copy of this stage's state, serves nothing until it takes over


class OuterRoundsRecord(BaseModel):
    """The outer-round settings a replica runs (`--averaging outer`): a replica that joins its stage
    with `--averaging auto` takes the same, so that their rounds meet."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    every_steps: int = Field(ge=1, le=1_000_000)
    fragments: int = Field(default=1, ge=1, le=4096)
    overlap: bool = False
    codec: str = Field(default="none", max_length=16)
    topk_fraction: float = Field(default=0.01, gt=0.0, le=1.0, allow_inf_nan=False)
    outer_lr: float = Field(default=0.7, ge=0.0, le=100.0, allow_inf_nan=False)
    outer_momentum: float = Field(default=0.9, ge=0.0, lt=1.0, allow_inf_nan=False)


class PeerRecord(BaseModel):
    """What a peer says about itself. Unknown fields are ignored so newer peers can add fields
    without breaking older readers; known fields are type-checked strictly."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    state: PeerState
    throughput: float = Field(ge=0.0, description="measured samples/s this peer can serve")
    load: float = Field(ge=0.0, default=0.0, description="requests in flight at announce time")
    version: str = Field(max_length=64, default="")
    protocol: int = Field(ge=0, default=PROTOCOL_VERSION)
    expires_at: float = Field(description="DHT time after which the record is stale")
    metrics_addr: str | None = Field(default=None, max_length=256)
    averaging: str = Field(default="none", max_length=16, description="none, sync, periodic or outer")
    precision: str = Field(
        default="", pattern="^(|fp32|bf16|fp16)$", description="what the peer computes in ('' = not stated: fp32)"
    )
    weight_prediction: str = Field(
        default="",
        pattern="^(|none|last-update|local-step)$",
        description="where a one-step-late sync replica computes ('' = not stated: on its parameters)",
    )
    vocab_size: int = Field(default=0, ge=0, description="the model's vocabulary size (0: not stated)")
    model_hash: str = Field(
        default="", max_length=64, description="models.identity.model_fingerprint of the served model ('' = not stated)"
    )
    credential: str | None = Field(
        default=None, max_length=4096, description="the peer's run credential (dht/authority.py), if it holds one"
    )
    steps_done: int = Field(
        default=0, ge=0, description="optimizer steps the served copy holds (a standby compares its copy with it)"
    )
    steps_per_s: float = Field(
        default=0.0, ge=0.0, allow_inf_nan=False, description="steps taken per second since the last announcement"
    )
    announced_at: float = Field(default=0.0, ge=0.0, allow_inf_nan=False, description="DHT time the record was made")
    run_id: str = Field(default="", max_length=64, description="the run whose spec the peer serves ('' = not stated)")
    spec_version: int = Field(default=0, ge=0, description="the version of the run's spec it follows (0 = not stated)")
    averaging_rounds: int = Field(default=0, ge=0, description="rounds averaged with other replicas of the stage")
    averaging_rounds_failed: int = Field(
        default=0, ge=0, description="rounds that failed (no group in time, or the all-reduce broke off)"
    )
    utilization: float = Field(
        default=0.0, ge=0.0, le=1.0, description="the busy fraction of its compute over the last minute"
    )
    averaging_reason: str = Field(default="", max_length=400, description="why this averaging (--averaging auto)")
    outer: OuterRoundsRecord | None = Field(default=None, description="outer mode: its settings")
    gloo: str | None = Field(
        default=None, max_length=64, pattern=r"^[0-9.]+:[0-9]+$", description="exact sync over gloo: its rendezvous"
    )
    sync_exchange: bool = Field(default=False, description="exact sync: fetches gradients over its own RPC")

    def to_wire(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        return data

    @classmethod
    def from_wire(cls, value: Any) -> PeerRecord:
        """Parse a DHT value; raises `ValueError` for anything malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a peer record must be a mapping, got {type(value).__name__}")
        try:
            return cls.model_validate({**value, "state": PeerState(value.get("state"))})
        except (ValidationError, ValueError) as e:
            raise ValueError(f"malformed peer record: {e}") from None


def parse_records(entries: dict[Any, Any], *, model: str, stage: int) -> list[PeerRecord]:
    """Parse every subkey of a stage key; skip (with a warning) what is malformed, belongs to
    another stage or model, or whose subkey does not match the peer id inside."""

    def misplaced(subkey, record: PeerRecord) -> str | None:
        if record.peer_id != subkey or record.model != model or record.stage != stage:
            return f"it names peer {record.peer_id}, model {record.model}, stage {record.stage}"
        return None

    return parse_entries(entries, PeerRecord.from_wire, misplaced, kind="DHT record", where=f"{model} stage {stage}")


class SplitRecord(BaseModel):
    """How one peer splits its model into stages: block boundaries (0, b_1, ..., n_layers), stage
    i holding blocks b_i .. b_{i+1}-1. Every peer states the split it serves, so that a peer with
    another split can refuse to start and a trainer can check that the swarm agrees."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=128)
    num_stages: int = Field(ge=1, le=1024)
    boundaries: tuple[int, ...] = Field(min_length=2, max_length=1025)
    since: float = Field(description="DHT time the peer first stated this split: the earlier claim wins a race")
    active: bool = Field(default=True, description="False once the peer has left: its claim binds nobody")
    expires_at: float

    @model_validator(mode="after")
    def _boundaries_describe_the_stages(self) -> SplitRecord:
        bounds = self.boundaries
        if len(bounds) != self.num_stages + 1 or bounds[0] != 0 or any(b >= a for b, a in zip(bounds, bounds[1:])):
            raise ValueError(f"boundaries {list(bounds)} do not describe {self.num_stages} non-empty stages")
        return self

    def same_split(self, other: SplitRecord) -> bool:
        return (self.num_stages, self.boundaries) == (other.num_stages, other.boundaries)

    def describe(self) -> str:
        return f"{self.num_stages} stages at block boundaries {','.join(map(str, self.boundaries))}"

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: Any) -> SplitRecord:
        """Parse a DHT value; raises `ValueError` for anything malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a split record must be a mapping, got {type(value).__name__}")
        bounds = value.get("boundaries")
        try:
            return cls.model_validate({**value, "boundaries": tuple(bounds) if isinstance(bounds, list) else bounds})
        except ValidationError as e:
            raise ValueError(f"malformed split record: {e.errors()[0]['msg']}") from None


def parse_split_records(entries: dict[Any, Any], *, model: str) -> list[SplitRecord]:
    """Parse every subkey of a model's split key; skip (with a warning) what is malformed, names
    another model, or whose subkey does not match the peer id inside."""
    return parse_entries(entries, SplitRecord.from_wire, misfiled_under(model), kind="split record", where=model)


class MoveClaim(BaseModel):
    """A peer's claim to make one move of a rebalancing plan (peers/placement/stage_moves.py):
    stated on the DHT before the move, so that peers whose snapshots each named themselves the
    mover agree on who moves (the rule is `peers.placement.rebalance.claim_verdict`)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=128)
    num_stages: int = Field(ge=2, le=1024)
    from_stage: int = Field(ge=0)
    to_stage: int = Field(ge=0)
    moves_from: int = Field(ge=1, le=1 << 20, description="moves out of from_stage in the claimant's plan")
    moves_to: int = Field(ge=1, le=1 << 20, description="moves into to_stage in the claimant's plan")
    since: float = Field(allow_inf_nan=False, description="DHT time of the claim: the earlier claim wins a race")
    active: bool = Field(default=True, description="False once withdrawn (lost the race, or stopped before moving)")
    expires_at: float = Field(allow_inf_nan=False)

    @model_validator(mode="after")
    def _stages_are_two_of_the_split(self) -> MoveClaim:
        if self.from_stage == self.to_stage:
            raise ValueError(f"a move from stage {self.from_stage} to itself")
        if max(self.from_stage, self.to_stage) >= self.num_stages:
            raise ValueError(f"stages {self.from_stage} -> {self.to_stage} are not both of {self.num_stages} stages")
        return self

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: Any) -> MoveClaim:
        """Parse a DHT value; raises `ValueError` for anything malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a move claim must be a mapping, got {type(value).__name__}")
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            raise ValueError(f"malformed move claim: {e.errors()[0]['msg']}") from None


def parse_move_claims(entries: dict[Any, Any], *, model: str) -> list[MoveClaim]:
    """Parse every subkey of a model's move-claims key; skip (with a warning) what is malformed,
    names another model, or whose subkey does not match the peer id inside."""
    return parse_entries(entries, MoveClaim.from_wire, misfiled_under(model), kind="move claim", where=model)
