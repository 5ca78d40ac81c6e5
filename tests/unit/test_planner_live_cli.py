"""``swarm plan --from-dht``: the argument errors that need no network are one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.planner.plan_cli import main


@pytest.mark.parametrize("argv, message", [
    (["--from-dht"], "needs --initial-peers"),
    (["--from-dht", "--topology", "t.json"], "either --topology or --from-dht"),
    ([], "--topology FILE.json and --out PLAN.json are required"),
    (["--topology", "t.json"], "are required"),
    (["--from-dht", "--stages", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"], "--stages must be at least 1"),
    (["--from-dht", "--plan-ttl-s", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"], "must be positive"),
    (["--from-dht", "--initial-peers", "127.0.0.1:31337"], "is not a multiaddr"),
])
def test_live_argument_errors_are_one_line(argv, message: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SWARM_INITIAL_PEERS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("swarm plan: error:")
    assert message in err
