"""Measured links between peers, published on the DHT for the live planner (`swarm plan --from-dht`).

Every peer probes a few other peers of its model now and then (peers/placement/link_probe.py) and states what
it measured as one `LinkRecord` under `links_key(model)`, subkey its peer id, with an expiry. A
record also carries what the planner needs to know about the peer itself: the stage it serves now,
the number of stages, and its measured throughput. Records are validated where they are read; a
malformed one is logged and skipped.
"""

from __future__ import annotations

from typing import Any

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dht.keys import links_key, peer_subkey
from dht.record_policy import CLOCK_SKEW_S, MAX_RECORD_TTL_S
from dht.signing import allowed_peers_of, identity_of, owned_entries
from dht.subkey_records import await_store, lookup, lookup_async, misfiled_under, parse_entries, restamping_store

MAX_LINKS_PER_RECORD = 256


class LinkMeasurement(BaseModel):
    """One directed link as its source measured it: round-trip time of a tiny echo, and the
    bandwidth of a larger echo once that round trip is taken out."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    rtt_ms: float = Field(ge=0.0, le=600_000.0, allow_inf_nan=False)
    bandwidth_gbps: float = Field(gt=0.0, le=100_000.0, allow_inf_nan=False)
    measured_at: float = Field(allow_inf_nan=False, description="DHT time of the measurement")


class LinkRecord(BaseModel):
    """What one peer measured to others, plus its own stage and capacity. Unknown fields are
    ignored (newer peers may add some); known ones are type-checked strictly."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=128)
    stage: int | None = Field(default=None, ge=0, description="stage served now (None: none yet)")
    num_stages: int = Field(ge=1, le=1024)
    throughput: float = Field(ge=0.0, allow_inf_nan=False, description="measured samples/s of its stage")
    measured_at: float = Field(allow_inf_nan=False, description="DHT time the record was made")
    expires_at: float = Field(allow_inf_nan=False, description="DHT time after which the record is stale")
    links: dict[str, LinkMeasurement] = Field(default_factory=dict, max_length=MAX_LINKS_PER_RECORD)

    @model_validator(mode="after")
    def _links_name_other_peers(self) -> LinkRecord:
        if self.peer_id in self.links:
            raise ValueError("a peer does not measure a link to itself")
        if any(not 1 <= len(target) <= 128 for target in self.links):
            raise ValueError("link targets must be peer ids of 1 to 128 characters")
        if self.stage is not None and self.stage >= self.num_stages:
            raise ValueError(f"stage {self.stage} is not one of {self.num_stages} stages")
        return self

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: Any) -> LinkRecord:
        """Parse a DHT value; raises `ValueError` for anything malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a link record must be a mapping, got {type(value).__name__}")
        links = value.get("links", {})
        if not isinstance(links, dict):
            raise ValueError(f"'links' must be a mapping, got {type(links).__name__}")
        try:
            return cls.model_validate(
                {**value, "links": {target: LinkMeasurement.model_validate(item) for target, item in links.items()}}
            )
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise ValueError(f"malformed link record: {where + ': ' if where else ''}{error['msg']}") from None


def parse_link_records(entries: dict[Any, Any], *, model: str, now: float | None = None) -> list[LinkRecord]:
    """Parse every subkey of a model's links key, sorted by peer id; skip (with a warning) what is
    malformed, names another model, or whose subkey does not match the peer id inside. With `now`
    (DHT time), also what was measured in the future or expires too late (beyond `CLOCK_SKEW_S`)."""
    misfiled = misfiled_under(model)

    def misplaced(subkey, record: LinkRecord) -> str | None:
        reason = misfiled(subkey, record)
        if reason is not None or now is None:
            return reason
        latest = max([record.measured_at, *(link.measured_at for link in record.links.values())])
        if latest > now + CLOCK_SKEW_S:
            return f"it was measured {latest - now:.0f} s in the future"
        if record.expires_at > now + MAX_RECORD_TTL_S + CLOCK_SKEW_S:
            return f"it expires in {record.expires_at - now:.0f} s, more than {MAX_RECORD_TTL_S:.0f} s"
        return None

    return parse_entries(entries, LinkRecord.from_wire, misplaced, kind="link record", where=model)


# --- DHT I/O -------------------------------------------------------------------------------------


async def publish_links_async(dht: hivemind.DHT, record: LinkRecord, *, timeout_s: float = 10.0) -> bool:
    """Store `record` for the lifetime its `expires_at` gives it. Returns whether it was stored."""
    subkey = peer_subkey(record.peer_id, identity_of(dht).owner_marker)
    store = restamping_store(dht, links_key(record.model), subkey, record)

    return await await_store(store, timeout_s=timeout_s, what=f"Publishing the links of {record.peer_id[-8:]}")


def _parse(dht: hivemind.DHT, entries: dict, model: str) -> list[LinkRecord]:
    # signed by the peer they name, one of a private swarm's peers
    entries = owned_entries(entries, what=f"{model} link records", allowed=allowed_peers_of(dht))
    return parse_link_records(entries, model=model, now=get_dht_time())


def fetch_link_records(dht: hivemind.DHT, model: str, *, timeout_s: float = 10.0) -> list[LinkRecord]:
    """Every unexpired link record of a model (blocking; malformed entries are skipped)."""
    return _parse(dht, lookup(dht, links_key(model), timeout_s=timeout_s), model)


async def fetch_link_records_async(dht: hivemind.DHT, model: str, *, timeout_s: float = 10.0) -> list[LinkRecord]:
    """Every unexpired link record of a model; [] (with a warning) when the lookup times out."""
    entries = await lookup_async(dht, links_key(model), timeout_s=timeout_s, what=f"the links of {model}")
    return _parse(dht, entries or {}, model)
