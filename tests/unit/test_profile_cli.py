"""`swarm profile` through the real command line: a profile file, a suggested split, one-line errors."""

from __future__ import annotations

import json

import pytest

from models.layer_costs import ModelProfile
from swarm.cli import main
from tests.unit.test_planner_opfence import synthetic_profile


def test_measures_and_suggests_a_split(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--model",
                "tiny",
                "--out",
                str(out),
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--num-stages",
                "2",
                "--stage-speeds",
                "1",
                "0.5",
            ]
        )
        == 0
    )
    profile = ModelProfile.read(out)
    assert profile.model == "tiny" and len(profile.layers) == 5
    split = json.loads(out.read_text())["suggested_split"]
    assert split["num_stages"] == 2 and split["boundaries"][0] == 0 and split["boundaries"][-1] == 3
    assert split["bottleneck_s"] <= split["equal_bottleneck_s"]
    assert f"--split-boundaries {','.join(map(str, split['boundaries']))}" in capsys.readouterr().out


def test_splits_an_existing_profile_without_measuring(tmp_path, capsys):
    source = tmp_path / "source.json"
    synthetic_profile(n_layers=4).write(source)
    out = tmp_path / "split.json"
    assert (
        main(
            [
                "profile",
                "--from-profile",
                str(source),
                "--out",
                str(out),
                "--num-stages",
                "2",
                "--stage-speeds",
                "1",
                "0.25",
            ]
        )
        == 0
    )
    split = json.loads(out.read_text())["suggested_split"]
    # Equal block costs, stage 1 four times slower: 4 blocks go 3 + 1, not 2 + 2.
    assert split["boundaries"] == [0, 3, 4] and split["equal_boundaries"] == [0, 2, 4]
    assert ModelProfile.read(out) == ModelProfile.read(source)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["profile", "--model", "tiny"], "--out is required"),
        (["profile", "--model", "nope", "--out", "x.json"], "unknown model"),
        (["profile", "--model", "tiny", "--out", "x.json", "--stage-speeds", "1", "1"], "needs --num-stages"),
        (
            ["profile", "--model", "tiny", "--out", "x.json", "--num-stages", "2", "--stage-speeds", "1"],
            "one value per stage",
        ),
        (["profile", "--from-profile", "/nonexistent.json", "--out", "x.json"], "cannot read profile"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
