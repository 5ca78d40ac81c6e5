"""Link records and plan records: what is valid on the wire, what a reader skips, whom a plan places."""

from __future__ import annotations

import math

import pytest

from dht.link_records import MAX_LINKS_PER_RECORD, LinkRecord, parse_link_records
from dht.plan_record import PlanRecord, current_plan, stage_in_plan


def link_wire(peer_id: str = "A", links: dict | None = None, **fields) -> dict:
    value = {
        "peer_id": peer_id,
        "model": "tiny",
        "stage": 0,
        "num_stages": 2,
        "throughput": 10.0,
        "measured_at": 100.0,
        "expires_at": 200.0,
        "links": {"B": {"rtt_ms": 2.0, "bandwidth_gbps": 1.5, "measured_at": 99.0}} if links is None else links,
    }
    value.update(fields)
    return value


def test_link_record_round_trips_through_the_wire() -> None:
    record = LinkRecord.from_wire(link_wire())
    assert record.links["B"].rtt_ms == 2.0 and record.links["B"].bandwidth_gbps == 1.5
    assert LinkRecord.from_wire(record.to_wire()) == record


def test_link_record_ignores_unknown_fields_from_newer_peers() -> None:
    record = LinkRecord.from_wire(
        link_wire(gpu="T4", links={"B": {"rtt_ms": 1.0, "bandwidth_gbps": 1.0, "measured_at": 1.0, "jitter_ms": 0.1}})
    )
    assert record.peer_id == "A"


@pytest.mark.parametrize(
    "value, message",
    [
        ([1, 2], "must be a mapping"),
        (link_wire(links=[1]), "'links' must be a mapping"),
        (link_wire(links={"A": {"rtt_ms": 1.0, "bandwidth_gbps": 1.0, "measured_at": 1.0}}), "to itself"),
        (link_wire(links={"B": {"rtt_ms": -1.0, "bandwidth_gbps": 1.0, "measured_at": 1.0}}), "rtt_ms"),
        (link_wire(links={"B": {"rtt_ms": 1.0, "bandwidth_gbps": 0.0, "measured_at": 1.0}}), "bandwidth_gbps"),
        (link_wire(links={"B": {"rtt_ms": 1.0, "bandwidth_gbps": math.inf, "measured_at": 1.0}}), "finite"),
        (link_wire(links={"B": {"rtt_ms": "1", "bandwidth_gbps": 1.0, "measured_at": 1.0}}), "rtt_ms"),
        (link_wire(links={"B": {"rtt_ms": 1.0, "measured_at": 1.0}}), "bandwidth_gbps"),
        (link_wire(links={"": {"rtt_ms": 1.0, "bandwidth_gbps": 1.0, "measured_at": 1.0}}), "1 to 128"),
        (link_wire(stage=2), "not one of 2 stages"),
        (link_wire(throughput=-1.0), "throughput"),
        (link_wire(peer_id=""), "peer_id"),
        (link_wire(num_stages="2"), "num_stages"),
    ],
)
def test_malformed_link_records_are_refused_with_a_reason(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkRecord.from_wire(value)


def test_a_link_record_holds_a_bounded_number_of_links() -> None:
    links = {
        f"P{i}": {"rtt_ms": 1.0, "bandwidth_gbps": 1.0, "measured_at": 1.0} for i in range(MAX_LINKS_PER_RECORD + 1)
    }
    with pytest.raises(ValueError, match="at most"):
        LinkRecord.from_wire(link_wire(links=links))


def test_reader_skips_malformed_and_misfiled_records(caplog: pytest.LogCaptureFixture) -> None:
    entries = {
        "A": link_wire("A"),
        "B": link_wire("B", links={}, throughput="fast"),
        "C": link_wire("A"),
        "D": link_wire("D", model="small", links={}),
        "E": link_wire("E", links={}),
    }
    records = parse_link_records(entries, model="tiny")
    assert [r.peer_id for r in records] == ["A", "E"]
    assert caplog.text.count("Skipping link record") == 3


# --- plans --------------------------------------------------------------------------------------


def plan_wire(stages=(("A", "B"), ("C", "D")), spares=("E",), planner_id="Q", created_at=100.0, **fields) -> dict:
    value = {
        "model": "tiny",
        "num_stages": len(stages),
        "stages": [list(g) for g in stages],
        "spares": list(spares),
        "total_s": 3.0,
        "data_parallel_s": 1.0,
        "pipeline_s": 2.0,
        "planner_id": planner_id,
        "created_at": created_at,
        "expires_at": created_at + 100.0,
    }
    value.update(fields)
    return value


def test_plan_round_trips_and_places_each_peer() -> None:
    plan = PlanRecord.from_wire(plan_wire())
    assert plan.stages == (("A", "B"), ("C", "D")) and plan.spares == ("E",)
    assert PlanRecord.from_wire(plan.to_wire()) == plan
    assert [stage_in_plan(plan, peer) for peer in "ABCD"] == [0, 0, 1, 1]
    assert stage_in_plan(plan, "E") is None  # a spare serves no planned stage
    assert stage_in_plan(plan, "Z") is None  # joined after the plan
    assert stage_in_plan(None, "A") is None
    assert plan.peer_ids == ("A", "B", "C", "D")


@pytest.mark.parametrize(
    "value, message",
    [
        ("plan", "must be a mapping"),
        (plan_wire(num_stages=3), "num_stages is 3"),
        (plan_wire(stages=(("A", "B"), ())), "at least one peer"),
        (plan_wire(stages=(("A", "B"), ("B", "C"))), "twice"),
        (plan_wire(spares=("A",)), "twice"),
        (plan_wire(total_s=4.0), "total_s"),
        (plan_wire(pipeline_s=-1.0, total_s=0.0), "pipeline_s"),
        (plan_wire(stages=(("A", ""),)), "1 to 128"),
        ({**plan_wire(), "stages": "AB"}, "stages"),
        ({**plan_wire(), "stages": [["A", 1], ["C"]]}, "stages"),
        (plan_wire(created_at=math.nan), "created_at"),
    ],
)
def test_malformed_plans_are_refused_with_a_reason(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlanRecord.from_wire(value)


def test_current_plan_is_the_newest_valid_unexpired_one(caplog: pytest.LogCaptureFixture) -> None:
    entries = {
        "Q": plan_wire(planner_id="Q", created_at=100.0),
        "R": plan_wire(planner_id="R", created_at=150.0, stages=(("D", "C"), ("B", "A"))),
        "S": plan_wire(planner_id="S", created_at=180.0, expires_at=190.0),  # newest but expired at 195
        "T": plan_wire(planner_id="T", created_at=190.0, total_s=9.0),  # malformed: newest valid-looking
        "U": plan_wire(planner_id="X", created_at=190.0),  # filed under another planner's subkey
        "V": plan_wire(planner_id="V", created_at=190.0, model="small"),
    }
    plan = current_plan(entries, model="tiny", now=195.0)
    assert plan is not None and plan.planner_id == "R"
    assert stage_in_plan(plan, "A") == 1
    assert caplog.text.count("Skipping plan record") == 3
    assert current_plan({}, model="tiny", now=0.0) is None
