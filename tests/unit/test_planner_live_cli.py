"""``swarm plan --from-dht``: the argument errors that need no network are one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.config import get_model_config
from process.config import from_sources
from swarm.planner.live_cli import DEFAULT_MACRO_BATCH_SAMPLES, _sizes
from swarm.planner.plan_cli import PlanConfig, main
from swarm.planner.topology import TopologyError


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--from-dht"], "needs --initial-peers"),
        (["--from-dht", "--topology", "t.json"], "either --topology or --from-dht"),
        ([], "--topology FILE.json and --out PLAN.json are required"),
        (["--topology", "t.json"], "are required"),
        (
            ["--from-dht", "--stages", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"],
            "--stages must be at least 1",
        ),
        (["--from-dht", "--plan-ttl-s", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"], "must be positive"),
        (["--from-dht", "--initial-peers", "127.0.0.1:31337"], "is not a multiaddr"),
    ],
)
def test_live_argument_errors_are_one_line(
    argv, message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SWARM_INITIAL_PEERS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("swarm plan: error:")
    assert message in err


def _size_args(**overrides) -> PlanConfig:
    dht = "/ip4/127.0.0.1/tcp/1/p2p/QmX"
    return from_sources(PlanConfig, env={}, from_dht=True, model="tiny", initial_peers=[dht], **overrides)


def test_transfer_sizes_come_from_the_model_unless_given() -> None:
    c_pp, c_dp = _sizes(_size_args(), stages=3)
    config = get_model_config("tiny")
    assert c_pp == pytest.approx(DEFAULT_MACRO_BATCH_SAMPLES * config.seq_len * config.d_model * 4 / 1e9)
    assert c_dp > 0
    assert _sizes(_size_args(c_pp_gb=0.5, c_dp_gb=0.25), stages=8) == (0.5, 0.25)  # 8 > tiny's 3 blocks: fine
    with pytest.raises(TopologyError, match="cannot be split into 8 stages"):
        _sizes(_size_args(), stages=8)
    with pytest.raises(TopologyError, match="--c-pp-gb must be positive"):
        _sizes(_size_args(c_pp_gb=-1.0, c_dp_gb=1.0), stages=2)
