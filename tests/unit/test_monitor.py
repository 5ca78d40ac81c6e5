"""`swarm monitor targets`: address validation, record merging, the file_sd file, the loop."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from dht.records import PeerRecord, PeerState
from process.config import ConfigError
from swarm import monitor
from swarm.cli import main
from swarm.monitor import MonitorConfig, TargetsWriter, file_sd_groups, merge_records, parse_metrics_addr


def record(
    peer: str,
    stage: int = 0,
    *,
    addr: str | None = "127.0.0.1:9000",
    state=PeerState.ONLINE,
    expires_at: float = 100.0,
    model: str = "tiny",
    num_stages: int = 2,
) -> PeerRecord:
    return PeerRecord(
        peer_id=peer,
        model=model,
        stage=stage,
        num_stages=num_stages,
        state=state,
        throughput=10.0,
        expires_at=expires_at,
        metrics_addr=addr,
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("127.0.0.1:9100", "127.0.0.1:9100"),
        (" 10.0.0.1:80 ", "10.0.0.1:80"),
        ("[::1]:9100", "[::1]:9100"),
        ("[2001:DB8::1]:9100", "[2001:db8::1]:9100"),
        ("Peer-3.example.org:9100", "peer-3.example.org:9100"),
    ],
)
def test_good_metrics_addresses_are_normalised(text, expected):
    assert parse_metrics_addr(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "0.0.0.0:9100",
        "[::]:9100",
        "::1:9100",
        "host:9100/metrics",
        "http://h:1",
        "a b:1",
        "-bad.example:1",
        "",
        "x" * 300 + ":1",
        "h:1\n- targets: [evil]",
    ],
)
def test_bad_metrics_addresses_are_refused(text):
    with pytest.raises(ValueError):
        parse_metrics_addr(text)


def test_merge_keeps_peers_until_they_leave_or_expire():
    known = merge_records({}, [record("a"), record("b"), record("c", expires_at=50.0)], now=10.0)
    assert sorted(known) == ["a", "b", "c"]
    # a lookup that found nothing (timed out) drops no one whose record is still valid
    assert sorted(merge_records(known, [], now=20.0)) == ["a", "b", "c"]
    # c's record expired; b announced offline; a is refreshed
    later = merge_records(known, [record("a", expires_at=200.0), record("b", state=PeerState.OFFLINE)], now=60.0)
    assert sorted(later) == ["a"] and later["a"].expires_at == 200.0


def test_merge_ignores_an_older_copy_of_a_record():
    known = merge_records({}, [record("a", stage=1, expires_at=200.0)], now=0.0)
    merged = merge_records(known, [record("a", stage=0, expires_at=150.0)], now=0.0)  # a moved 0 -> 1
    assert merged["a"].stage == 1


def test_file_sd_groups_by_stage_sorted_and_skips_peers_without_a_good_address():
    records = [
        record("d", 1, addr="127.0.0.1:9004"),
        record("a", 0, addr="127.0.0.1:9002"),
        record("b", 0, addr="127.0.0.1:9001"),
        record("c", 1, addr=None),
        record("e", 1, addr="nonsense"),
    ]
    assert file_sd_groups(records) == [
        {
            "targets": ["127.0.0.1:9001", "127.0.0.1:9002"],
            "labels": {"swarm_model": "tiny", "swarm_stage": "0", "swarm_num_stages": "2"},
        },
        {"targets": ["127.0.0.1:9004"], "labels": {"swarm_model": "tiny", "swarm_stage": "1", "swarm_num_stages": "2"}},
    ]
    assert file_sd_groups([]) == []


class FakeLookups:
    """Stands in for the DHT: what each stage returns, changed between passes."""

    def __init__(self):
        self.by_stage: dict[int, list[PeerRecord]] = {}
        self.asked: list[int] = []

    async def __call__(self, dht, model, stage, *, timeout_s):
        self.asked.append(stage)
        return list(self.by_stage.get(stage, []))


def test_the_writer_rewrites_the_file_only_when_targets_change(tmp_path, monkeypatch):
    lookups = FakeLookups()
    monkeypatch.setattr(monitor, "fetch_stage_records_async", lookups)
    monkeypatch.setattr(monitor, "get_dht_time", lambda: 10.0)
    out = tmp_path / "peers.json"
    writer = TargetsWriter(MonitorConfig(out=str(out), model="tiny"), dht=None)
    lookups.by_stage = {
        0: [record("a", 0, addr="127.0.0.1:9001", num_stages=3)],
        2: [record("c", 2, addr="127.0.0.1:9003", num_stages=3)],
    }
    assert asyncio.run(writer.refresh()) is True
    assert sorted(lookups.asked) == [0, 1, 2]  # the stage count came from the records
    groups = json.loads(out.read_text())
    assert [g["targets"] for g in groups] == [["127.0.0.1:9001"], ["127.0.0.1:9003"]]
    mtime = os.stat(out).st_mtime_ns
    lookups.by_stage = {}  # every lookup times out: the records have not expired, nothing changes
    assert asyncio.run(writer.refresh()) is False
    assert os.stat(out).st_mtime_ns == mtime
    lookups.by_stage = {0: [record("a", 0, state=PeerState.OFFLINE, num_stages=3, expires_at=101.0)]}
    assert asyncio.run(writer.refresh()) is True
    assert [g["targets"] for g in json.loads(out.read_text())] == [["127.0.0.1:9003"]]
    assert sorted(os.listdir(tmp_path)) == ["peers.json"]  # no temporary file left behind


def test_the_writer_writes_an_empty_list_when_there_are_no_peers(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor, "fetch_stage_records_async", FakeLookups())
    out = tmp_path / "peers.json"
    asyncio.run(TargetsWriter(MonitorConfig(out=str(out), model="tiny"), dht=None).refresh())
    assert json.loads(out.read_text()) == []


def test_monitor_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="--out is required"):
        MonitorConfig()
    with pytest.raises(ConfigError, match="does not exist"):
        MonitorConfig(out=str(tmp_path / "missing" / "peers.json"))
    with pytest.raises(ConfigError, match="positive"):
        MonitorConfig(out=str(tmp_path / "p.json"), period_s=0)


def test_the_cli_reports_a_missing_out_in_one_line(capsys):
    assert main(["monitor", "targets"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "swarm monitor: error: --out is required (the file_sd JSON file to keep up to date)"


def test_a_private_swarm_lists_only_allowed_peers_metrics_addresses():
    records = [record("allowed", addr="10.0.0.1:9100"), record("stranger", addr="10.9.9.9:22")]
    assert [g["targets"] for g in file_sd_groups(records, allowed_peers=["allowed"])] == [["10.0.0.1:9100"]]
    assert [g["targets"] for g in file_sd_groups(records)] == [["10.0.0.1:9100", "10.9.9.9:22"]]  # an open swarm
