"""Contribution accounting (issue #25): the trainer's per-peer ledger, its place in the report, and
`swarm status --report` reading it back."""

from __future__ import annotations

import json

import pytest

from swarm.status import format_contributions
from swarm.trainer.contributions import ContributionLedger, ReportError, read_reported_contributions
from swarm.trainer.run import TrainingReport


def test_answered_backwards_count_samples_served_and_forwards_only_calls():
    ledger = ContributionLedger()
    ledger.answered("p", 1, "forward", 4)  # a forward, a check's or a validation pass's: no step follows from it
    ledger.answered("p", 1, "backward", 4)
    ledger.answered("p", 1, "forward", 2)
    ledger.failed("p", 1)
    entry = ledger.get("p")
    assert (entry.stage, entry.samples_served, entry.calls_answered, entry.calls_failed) == (1, 4, 3, 1)
    assert ledger.get("other") is None


def test_a_check_counts_for_every_replica_asked_and_a_mismatch_for_those_not_in_the_majority():
    ledger = ContributionLedger()
    ledger.verified(0, ["a", "b"], agreed=True)
    ledger.verified(0, ["liar", "a", "b"], agreed=False, majority={"a", "b"})
    ledger.verified(0, ["a", "liar"], agreed=False)  # undecided: either could be the liar
    counts = {p: (e["calls_verified"], e["mismatches"]) for p, e in ledger.snapshot().items()}
    assert counts == {"a": (3, 1), "b": (2, 0), "liar": (2, 2)}


def test_a_ban_keeps_its_reason_and_the_peers_last_stage():
    ledger = ContributionLedger()
    ledger.answered("p", 0, "forward", 2)
    ledger.banned("p", 1, "stage 1: its answer differed")
    assert ledger.snapshot()["p"]["banned"] == "stage 1: its answer differed"
    assert ledger.snapshot()["p"]["stage"] == 1


def test_memory_is_bounded_and_the_least_recent_unbanned_peer_goes_first():
    ledger = ContributionLedger(max_peers=3)
    ledger.banned("liar", 0, "lied")
    for peer in ("a", "b", "c"):
        ledger.answered(peer, 0, "forward", 1)
    assert set(ledger.snapshot()) == {"liar", "b", "c"}  # a, unbanned and oldest, forgotten
    ledger.answered("b", 0, "forward", 1)
    ledger.answered("d", 0, "forward", 1)
    assert set(ledger.snapshot()) == {"liar", "b", "d"}
    full = ContributionLedger(max_peers=2)
    full.banned("x", 0, "lied")
    full.banned("y", 0, "lied")
    full.answered("z", 0, "forward", 1)  # all others banned: the oldest ban goes, never the newcomer
    assert set(full.snapshot()) == {"y", "z"}
    with pytest.raises(ValueError, match="max_peers"):
        ContributionLedger(max_peers=0)


def test_a_resumed_run_adds_its_counts_to_the_earlier_reports():
    ledger = ContributionLedger()
    ledger.answered("a", 1, "backward", 4)
    ledger.verified(1, ["a"], agreed=True)
    earlier = {
        "a": {"stage": 0, "samples_served": 10, "calls_answered": 5, "calls_failed": 2, "calls_verified": 1,
              "mismatches": 0, "banned": None},
        "gone": {"stage": 0, "samples_served": 3, "calls_answered": 1, "calls_failed": 0, "calls_verified": 0,
                 "mismatches": 1, "banned": "lied"},
    }  # fmt: skip
    merged = ledger.merge(earlier)
    assert merged["a"] == {  # an earlier report without samples_verified and disputes (before issue #59)
        "stage": 1, "samples_served": 14, "calls_answered": 6, "calls_failed": 2, "calls_verified": 2,
        "mismatches": 0, "samples_verified": 0, "disputes": 0, "banned": None,
    }  # fmt: skip
    assert merged["gone"] == earlier["gone"] and merged["gone"] is not earlier["gone"]
    assert ledger.merge(earlier) == merged  # merging again from the same base gives the same: no double count


def test_the_report_carries_contributions_and_status_reads_them_back(tmp_path):
    ledger = ContributionLedger()
    ledger.answered("QmHonest0000000000000001", 0, "backward", 8)
    ledger.answered("QmLiar00000000000000LIAR", 0, "backward", 2)
    ledger.verified(0, ["QmLiar00000000000000LIAR", "QmHonest0000000000000001"], agreed=False)
    ledger.banned("QmLiar00000000000000LIAR", 0, "stage 0: its forward answer differed")
    ledger.busy("QmHonest0000000000000001", 0, (10.0, 100.0))  # its compute clock in two answers:
    ledger.busy("QmHonest0000000000000001", 0, (19.2, 110.0))  # 9.2 s busy of 10 s
    report = TrainingReport(model="tiny", num_stages=2, contributions=ledger.snapshot())
    report.banned_peers = {"QmLiar00000000000000LIAR": "stage 0: its forward answer differed"}
    path = tmp_path / "report.json"
    report.write(str(path))
    assert TrainingReport.load(str(path), model="tiny").contributions == ledger.snapshot()

    read = read_reported_contributions(str(path))
    assert read["QmLiar00000000000000LIAR"].mismatches == 1 and read["QmHonest0000000000000001"].samples_served == 8
    lines = format_contributions(read).splitlines()
    assert lines[0] == "contributions to the trainer (its report): 2 peers"
    assert lines[1].split() == [
        *("stage", "peer", "samples", "answered", "failed", "checked", "mismatch", "disputes", "ok", "samples"),
        *("busy", "banned"),
    ]
    assert lines[2].split() == [
        "0",
        "…000000000001",
        "8",
        "1",
        "0",
        "1",
        "1",
        "0",
        "0",
        "92%",
        "-",
    ]  # most samples first
    assert lines[3].split()[:10] == ["0", "…00000000LIAR", "2", "1", "0", "1", "1", "0", "0", "-"]
    assert lines[3].endswith("stage 0: its forward answer differed")


def test_samples_a_check_found_right_count_for_the_checked_replica_and_disputes_for_both():
    ledger = ContributionLedger()
    ledger.verified(0, ["a", "b"], agreed=True, checked="a", samples=4)  # a's call of 4 samples, right
    ledger.verified(0, ["liar", "a", "b"], agreed=False, majority={"a", "b"}, checked="liar", samples=4)
    ledger.verified(0, ["b", "liar", "a"], agreed=False, majority={"a", "b"}, checked="b", samples=2)
    ledger.disputed(1, ("c", "d"))
    counts = {p: (e["samples_verified"], e["disputes"]) for p, e in ledger.snapshot().items()}
    assert counts == {"a": (4, 0), "b": (2, 0), "liar": (0, 0), "c": (0, 1), "d": (0, 1)}


@pytest.mark.parametrize(
    "content, complaint",
    [
        ("not json", "cannot read"),
        (json.dumps({"steps": 3}), "no `contributions` map"),
        (json.dumps({"contributions": {"p": {"stage": -1}}}), "malformed"),
        (json.dumps({"contributions": {"p": {"stage": 0, "samples_served": "many", "calls_answered": 0,
                                             "calls_failed": 0, "calls_verified": 0, "mismatches": 0}}}), "malformed"),
    ],
)  # fmt: skip
def test_a_report_that_is_not_a_trainers_is_refused_with_what_is_wrong(tmp_path, content, complaint):
    path = tmp_path / "report.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=complaint):
        read_reported_contributions(str(path))
    with pytest.raises(ReportError, match="cannot read"):
        read_reported_contributions(str(tmp_path / "missing.json"))


def test_a_peers_utilization_is_its_busy_fraction_between_its_first_and_latest_answers():
    ledger = ContributionLedger()
    ledger.busy("QmA", 0, (1.0, 1.0))  # never answered: nothing kept
    assert ledger.get("QmA") is None
    ledger.answered("QmA", 0, "backward", 4)
    ledger.busy("QmA", 0, (5.0, 50.0))
    assert ledger.get("QmA").utilization is None  # one reading spans no time
    ledger.busy("QmA", 0, (14.0, 60.0))
    assert ledger.get("QmA").utilization == 0.9
    ledger.busy("QmA", 0, (0.5, 2.0))  # its clock went back: restarted, measured afresh from here
    ledger.busy("QmA", 0, (1.0, 3.0))
    assert ledger.get("QmA").utilization == 0.5
