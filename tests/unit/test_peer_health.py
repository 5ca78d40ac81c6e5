"""The peer's status file and `python -m peers.health`, the container's health check."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dht.records import PeerRecord, PeerState
from peers.health import EXIT_HEALTHY, EXIT_UNHEALTHY, HealthError, main, problem, read_status, write_status

ROOT = Path(__file__).resolve().parents[2]


def record(state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(
        peer_id="QmPeerIdOfSomeVolunteer",
        model="tiny",
        stage=1,
        num_stages=2,
        state=state,
        throughput=10.0,
        load=0.0,
        version="test",
        expires_at=time.time() + 15,
    )


def write(path, state=PeerState.ONLINE, announced=True, ttl_s=15.0) -> None:
    assert write_status(
        str(path), record(state), announced=announced, ttl_s=ttl_s, requests_served=7, requests_failed=1
    )


def test_an_online_fresh_announced_peer_is_healthy(tmp_path):
    write(tmp_path / "status.json")
    status = read_status(str(tmp_path / "status.json"))
    assert (status.stage, status.state, status.requests_served) == (1, PeerState.ONLINE, 7)
    assert problem(status, time.time()) is None
    assert main(["--status-file", str(tmp_path / "status.json")]) == EXIT_HEALTHY


@pytest.mark.parametrize("state", [PeerState.JOINING, PeerState.OFFLINE])
def test_a_peer_that_is_not_online_is_unhealthy(tmp_path, state):
    write(tmp_path / "status.json", state=state)
    assert state.value in problem(read_status(str(tmp_path / "status.json")), time.time())
    assert main(["--status-file", str(tmp_path / "status.json")]) == EXIT_UNHEALTHY


def test_a_stale_status_means_the_peer_stopped_announcing(tmp_path):
    write(tmp_path / "status.json", ttl_s=15.0)
    status = read_status(str(tmp_path / "status.json"))
    assert problem(status, status.written_at + 14.0) is None
    assert "stopped announcing" in problem(status, status.written_at + 16.0)


def test_an_announcement_the_dht_did_not_store_is_unhealthy(tmp_path):
    write(tmp_path / "status.json", announced=False)
    assert "not stored" in problem(read_status(str(tmp_path / "status.json")), time.time())


def test_missing_or_malformed_status_is_unhealthy_with_a_reason(tmp_path, capsys):
    with pytest.raises(HealthError, match="not announced itself yet"):
        read_status(str(tmp_path / "absent.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"state": "online"}))
    with pytest.raises(HealthError, match="malformed"):
        read_status(str(tmp_path / "bad.json"))
    assert main(["--status-file", str(tmp_path / "bad.json")]) == EXIT_UNHEALTHY
    assert capsys.readouterr().err.startswith("unhealthy: malformed status file")


def test_the_status_file_comes_from_the_environment_like_every_peer_option(tmp_path):
    """The image sets SWARM_STATUS_FILE once; the peer writes there and the HEALTHCHECK reads there."""
    write(tmp_path / "status.json")
    result = subprocess.run(
        [sys.executable, "-m", "peers.health"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"SWARM_STATUS_FILE": str(tmp_path / "status.json"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == EXIT_HEALTHY, result.stderr
    assert result.stdout.startswith("healthy: serving tiny stage 1/2")
    assert (
        "torch"
        not in subprocess.run(  # cheap enough to run every 30 s
            [sys.executable, "-c", "import sys, peers.health; print(' '.join(sys.modules))"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        ).stdout.split()
    )


def test_an_unwritable_status_file_does_not_raise(tmp_path):
    (tmp_path / "a-file").write_text("")  # a folder that cannot be made: a file has its name
    assert not write_status(
        str(tmp_path / "a-file" / "status.json"),
        record(),
        announced=True,
        ttl_s=15.0,
        requests_served=0,
        requests_failed=0,
    )
