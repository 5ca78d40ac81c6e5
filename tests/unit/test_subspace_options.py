"""`--subspace-rank` / `--subspace-kind`: one section, applied to the model's config, passed on by the demo."""

import pytest

from models.config import get_model_config
from models.identity import model_fingerprint
from models.subspace_options import SubspaceSettings
from process.config import ConfigError


def test_off_leaves_the_config_and_passes_no_flags():
    config = get_model_config("tiny")
    assert SubspaceSettings().apply(config) is config
    assert SubspaceSettings().args() == []


def test_on_changes_the_model_and_its_fingerprint_and_passes_the_flags():
    config = get_model_config("tiny")
    options = SubspaceSettings(subspace_rank=8, subspace_kind="learned")
    applied = options.apply(config)
    assert (applied.subspace_rank, applied.subspace_kind) == (8, "learned")
    assert model_fingerprint(applied) != model_fingerprint(config)
    assert model_fingerprint(applied) != model_fingerprint(SubspaceSettings(subspace_rank=8).apply(config))
    assert options.args() == ["--subspace-rank", "8", "--subspace-kind", "learned"]


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="--subspace-rank -1"):
        SubspaceSettings(subspace_rank=-1)
    with pytest.raises(ConfigError, match="--subspace-kind 'random'"):
        SubspaceSettings(subspace_rank=4, subspace_kind="random")
    too_wide = SubspaceSettings(subspace_rank=10_000)
    with pytest.raises(ConfigError, match="--subspace-rank 10000"):
        too_wide.apply(get_model_config("tiny"))
