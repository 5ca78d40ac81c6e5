"""`swarm status`'s table: one line per peer with its state, throughput, load, compute utilisation,
version and metrics address."""

from __future__ import annotations

from dht.records import OuterRoundsRecord, PeerRecord, PeerState
from swarm.status import format_table


def record(peer: str, stage: int, state=PeerState.ONLINE, metrics_addr=None, utilization=0.0) -> PeerRecord:
    return PeerRecord(
        peer_id=peer,
        model="tiny",
        stage=stage,
        num_stages=2,
        state=state,
        throughput=120.0,
        load=3.0,
        version="0.1.0",
        expires_at=1e12,
        metrics_addr=metrics_addr,
        utilization=utilization,
    )


def test_the_table_lists_peers_per_stage_with_their_metrics_address():
    text = format_table(
        "tiny",
        {
            0: [
                record("QmAAAAAAAAAAAAAAAAA0", 0, metrics_addr="127.0.0.1:9100", utilization=0.934),
                record("QmBBBBBBBBBBBBBBBBB1", 0, state=PeerState.OFFLINE),
            ],
            1: [],
        },
    )
    lines = text.splitlines()
    assert lines[0] == "model tiny: 2 stages"
    header = ["stage", "peer", "state", "samples/s", "load", "busy", "steps", "rounds", "version", "metrics"]
    assert lines[1].split() == header
    assert lines[2].split() == [
        "0",
        "…AAAAAAAAAAA0",
        "online",
        "120.0",
        "3",
        "93%",
        "0",
        "-",
        "0.1.0",
        "127.0.0.1:9100",
    ]
    assert lines[3].split()[-1] == "-" and "offline" in lines[3]
    assert "stage 0: 1 online, 120.0 samples/s" in lines[4]
    assert "stage 0: averaging none" in lines[5]
    assert lines[6].split() == ["1", "(no", "peers)"]


def test_each_stage_says_how_its_replicas_agree_and_why():
    outer = OuterRoundsRecord(every_steps=100, codec="int8", overlap=True)
    a = record("QmAAAAAAAAAAAAAAAAA0", 0).model_copy(
        update={"averaging": "outer", "outer": outer, "averaging_reason": "exact sync's all-reduce would take ~4 s"}
    )
    b = record("QmBBBBBBBBBBBBBBBBB1", 1).model_copy(update={"averaging": "sync"})
    text = format_table("tiny", {0: [a], 1: [b]})
    assert (
        "stage 0: averaging outer (every 100 steps, int8, overlapped, outer lr 0.7 momentum 0.9): exact sync's "
        "all-reduce would take ~4 s" in text
    )
    assert "stage 1: averaging sync" in text


def test_a_stage_whose_replicas_do_not_average_is_warned_about():
    def averaging(peer, stage, mode, state=PeerState.ONLINE):
        return record(peer, stage, state=state).model_copy(update={"averaging": mode})

    stages = {
        0: [averaging("QmA0", 0, "none"), averaging("QmB0", 0, "none")],
        1: [averaging("QmA1", 1, "sync"), averaging("QmB1", 1, "sync")],
        2: [averaging("QmA2", 2, "none"), averaging("QmB2", 2, "none", state=PeerState.OFFLINE)],
        3: [averaging("QmA3", 3, "sync"), averaging("QmB3", 3, "periodic")],
    }
    warnings = [line for line in format_table("tiny", stages).splitlines() if line.startswith("warning")]
    assert len(warnings) == 2, warnings
    assert "stage 0: 2 replicas" in warnings[0] and "--averaging none" in warnings[0]
    assert "stage 3" in warnings[1] and "periodic/sync" in warnings[1]


def test_a_replica_whose_averaging_rounds_often_fail_is_named_with_its_counts():
    def replica(peer, ok, failed, state=PeerState.ONLINE):
        update = {"averaging": "sync", "averaging_rounds": ok, "averaging_rounds_failed": failed, "steps_done": ok}
        return record(peer, 0, state=state).model_copy(update=update)

    stages = {0: [replica("QmGOOD0", 40, 2), replica("QmFLAKY", 30, 6), replica("QmGONE0", 1, 9, PeerState.OFFLINE)]}
    lines = format_table("tiny", stages).splitlines()
    assert lines[3].split()[6:8] == ["30", "30/6"]  # steps, rounds completed/failed
    warnings = [line for line in lines if line.startswith("warning")]
    assert len(warnings) == 1 and "QmFLAKY" in warnings[0] and "6 of 36 averaging rounds failed" in warnings[0]


def test_a_swarm_without_peers_says_so_in_one_line():
    for stages in ({0: []}, {0: [], 1: []}):
        (line,) = format_table("small", stages).splitlines()
        assert line.startswith("model small: no peers on the DHT") and "--initial-peers" in line, line
    assert format_table("tiny", {0: [record("QmAAAAAAAAAAAAAAAAA0", 0)]}).splitlines()[0] == "model tiny: 1 stage"
