"""Nested configuration: sections keep their flags' and variables' names, and each validates itself."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from process.config import ConfigError, add_config_arguments, describe, env_variables, from_sources, option, section


@dataclasses.dataclass(kw_only=True)
class Inner:
    timeout_s: float = option(30.0, help="seconds")

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError("--timeout-s must be positive")


@dataclasses.dataclass(kw_only=True)
class Middle:
    codec: str = option("none", help="codec", choices=["none", "int8"])
    inner: Inner = section(Inner, help="deeper")


@dataclasses.dataclass(kw_only=True)
class Outer:
    stage: int = option(0, help="stage")
    peers: list[str] = option(default_factory=list, help="peers")
    middle: Middle = section(Middle, help="a section")


def _parser(cls=Outer) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    return parser


def test_flags_and_variables_of_sections_keep_their_leaf_names():
    config = from_sources(Outer, _parser().parse_args(["--codec", "int8"]), env={"SWARM_TIMEOUT_S": "2.5"})
    assert config.middle.codec == "int8" and config.middle.inner.timeout_s == 2.5 and config.stage == 0
    assert env_variables(Outer) == {"SWARM_STAGE", "SWARM_PEERS", "SWARM_CODEC", "SWARM_TIMEOUT_S"}


def test_a_flag_wins_over_its_variable_and_defaults_fill_the_rest():
    args = _parser().parse_args(["--timeout-s", "4", "--peers", "a", "b"])
    config = from_sources(Outer, args, env={"SWARM_TIMEOUT_S": "2.5", "SWARM_STAGE": "3"})
    assert (config.middle.inner.timeout_s, config.stage, config.peers, config.middle.codec) == (
        4.0,
        3,
        ["a", "b"],
        "none",
    )


def test_a_section_validates_its_own_fields():
    with pytest.raises(ConfigError, match="--timeout-s must be positive"):
        from_sources(Outer, env={"SWARM_TIMEOUT_S": "-1"})


def test_overrides_name_leaves_or_whole_sections():
    assert from_sources(Outer, env={}, timeout_s=9.0).middle.inner.timeout_s == 9.0
    assert from_sources(Outer, env={}, middle=Middle(codec="int8")).middle.codec == "int8"


def test_sections_get_help_groups_and_duplicate_leaf_names_are_refused():
    help_text = _parser().format_help()
    assert "middle:" in help_text and "inner:" in help_text and "--timeout-s" in help_text

    @dataclasses.dataclass(kw_only=True)
    class Clash:
        codec: str = option("none", help="twice")
        middle: Middle = section(Middle, help="has a codec too")

    with pytest.raises(TypeError, match="'codec' appears twice"):
        _parser(Clash)


def test_describe_prints_a_block_per_section():
    text = describe(from_sources(Outer, env={}))
    assert text.splitlines()[0] == "Outer:" and "  middle:" in text and "    inner:" in text
    assert "      timeout_s = 30.0" in text
