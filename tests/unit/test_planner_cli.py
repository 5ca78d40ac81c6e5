"""``swarm plan`` as a function and as ``python -m swarm.planner.plan_cli``."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from process.config import add_config_arguments
from swarm.planner.cost import evaluate_plan, pair_costs
from swarm.planner.plan_cli import PlanConfig, main, run_plan
from swarm.planner.topology import load_topology
from tests.unit.test_planner_cost import small_topology_dict

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def topology_file(tmp_path: Path) -> Path:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(small_topology_dict(3, 3, 5)))
    return path


def test_round_trip_writes_a_plan_with_its_cost(topology_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "nested" / "plan.json"
    assert (
        main(
            [
                "--topology",
                str(topology_file),
                "--out",
                str(out),
                "--seed",
                "4",
                "--time-limit-s",
                "10",
                "--patience-rounds",
                "3",
            ]
        )
        == 0
    )
    plan = json.loads(out.read_text())
    assert plan["seed"] == 4
    assert plan["search_time_s"] > 0
    groups = np.array(plan["groups"])
    assert groups.shape == (3, 3)
    cost = evaluate_plan(pair_costs(load_topology(topology_file)), groups)
    assert plan["cost"]["total_s"] == pytest.approx(cost.total_s)
    assert plan["cost"]["data_parallel_s"] + plan["cost"]["pipeline_s"] == pytest.approx(plan["cost"]["total_s"])


def test_works_as_a_subcommand(topology_file: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="swarm")
    add_config_arguments(parser.add_subparsers(dest="command").add_parser("plan"), PlanConfig)
    args = parser.parse_args(
        ["plan", "--topology", str(topology_file), "--out", str(tmp_path / "p.json"), "--patience-rounds", "2"]
    )
    assert run_plan(args) == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read topology file"),
        ("{oops", "not valid JSON"),
        (json.dumps({"stages": 2}), "missing field 'replicas'"),
        (json.dumps({**small_topology_dict(2, 2, 0), "replicas": 3}), "stages \\* replicas = 6"),
    ],
)
def test_bad_topology_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "topology.json"
    if content is not None:
        path.write_text(content)
    code = main(["--topology", str(path), "--out", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("swarm plan: error:")
    assert re.search(message, err)
    assert not (tmp_path / "plan.json").exists()


def test_bad_time_limit_is_rejected(topology_file: Path, tmp_path: Path) -> None:
    assert main(["--topology", str(topology_file), "--out", str(tmp_path / "p.json"), "--time-limit-s", "0"]) == 2


def test_runs_standalone_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[]")
    completed = subprocess.run(
        [sys.executable, "-m", "swarm.planner.plan_cli", "--topology", str(path), "--out", str(tmp_path / "plan.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert "must be a JSON object" in completed.stderr
