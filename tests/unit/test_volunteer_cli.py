"""A volunteer's `swarm peer --help` (issue #58): the flags that say where and how much, 15 at most,
each of them also a SWARM_* variable; the rest behind `--help-all`, fault injection behind one
developer option."""

from __future__ import annotations

import argparse
import contextlib
import io
import re

import pytest

from peers.config import PeerConfig
from process.config import ConfigError, from_sources, given_options
from swarm.cli import build_parser

MAX_VOLUNTEER_FLAGS = 15
# a value each volunteer flag accepts, as a command-line word and as an environment variable
VALUES = {
    "--initial-peers": "/ip4/127.0.0.1/tcp/31337/p2p/QmXeJ1gN6Vft1PyTUwGYGtLrLKHg7WXDXpsLdhKJwfmLXs",
    "--host-maddrs": "/ip4/0.0.0.0/tcp/31338",
    "--announce-maddrs": "/ip4/203.0.113.7/tcp/31338",
    "--identity-path": "/data/identity.key",
    "--run": "myrun/run.json",
    "--credential": "peer.cred",
    "--stage": "1",
    "--device": "cpu",
    "--memory-limit-gb": "3.5",
    "--checkpoint-dir": "/data/ckpt",
    "--metrics-port": "9100",
}


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["peer", *argv])
    return out.getvalue()


def listed_flags(text: str) -> list[str]:
    """The flags the help's option lines start with (one per option; --x/--no-x counts once)."""
    return [m.group(1) for m in re.finditer(r"^  (-{1,2}[a-z][a-z-]*)", text, re.M)]


def test_swarm_peer_help_lists_fifteen_flags_or_fewer_and_each_works_as_a_variable():
    flags = listed_flags(help_text("--help"))
    assert len(flags) <= MAX_VOLUNTEER_FLAGS, flags
    assert {"--initial-peers", "--credential", "--device", "--memory-limit-gb", "--checkpoint-dir"} <= set(flags)
    assert not [f for f in flags if f.startswith("--fault")] and "--lr" not in flags and "--optimizer" not in flags
    checked = 0
    for flag in set(flags) - {"-h", "--help", "--help-all"}:
        dest = flag.removeprefix("--").replace("-", "_")
        if flag == "--verbose":
            from swarm.cli import verbose

            assert verbose(argparse.Namespace(verbose=None)) in (True, False)
            continue
        variable = "SWARM_" + dest.upper()
        by_flag = from_sources(PeerConfig, build_parser().parse_args(["peer", flag, VALUES[flag]]), env={})
        by_variable = from_sources(PeerConfig, build_parser().parse_args(["peer"]), env={variable: VALUES[flag]})
        assert by_flag == by_variable, flag
        assert given_options(PeerConfig, None, env={variable: VALUES[flag]}) == {dest}
        assert by_variable != PeerConfig(), f"{variable} changed nothing"
        checked += 1
    assert checked >= 10


def test_help_all_lists_every_flag_and_the_developer_option():
    full = listed_flags(help_text("--help-all"))
    assert len(full) > 80 and {"--lr", "--optimizer", "--faults", "--averaging"} <= set(full)


def test_fault_injection_is_one_developer_option():
    args = build_parser().parse_args(["peer", "--faults", "slowdown=3,slowdown_mode=busy,wrong_stage"])
    faults = from_sources(PeerConfig, args, env={}).faults
    assert (faults.fault_slowdown, faults.fault_slowdown_mode, faults.fault_wrong_stage) == (3.0, "busy", True)
    assert from_sources(PeerConfig, None, env={"SWARM_FAULTS": "garbage=nan"}).faults.fault_garbage == "nan"
    for text, words in (("slow=3", "not one of"), ("slowdown", "give a value"), ("slowdown=x", "expected float")):
        with pytest.raises(ConfigError, match=words):
            from_sources(PeerConfig, build_parser().parse_args(["peer", "--faults", text]), env={})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer", "--fault-slowdown", "3"])  # the 14 flags are gone
