"""The README tells the truth about the CLI: every `swarm ...` command it shows parses with the
CLI's own parser (parsed only, never run), every flag it names exists, and every flag of every
command has its SWARM_* variable, as the README promises."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from swarm.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
NOT_OURS = ("docker", "podman", "pip", "make")  # commands of other programs whose flags the README shows


def _code_lines(text: str) -> list[str]:
    """Lines of fenced blocks, indented blocks and `inline code`, continuation lines joined."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            lines.append(line.strip())
        else:
            lines += [c for c in re.findall(r"`(swarm [^`]+)`", line) if " --" in c]  # not a bare name
    joined, pending = [], ""
    for line in lines:
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return joined


def readme_commands() -> list[str]:
    commands = []
    for line in _code_lines(README.read_text()):
        line = line.split(" #", 1)[0].strip().rstrip("&").strip()
        if line.startswith("swarm ") and "COMMAND" not in line:
            commands.append(line)
    return commands


def _tokens(command: str) -> list[str]:
    """The words of a command as a user would type them, with the README's notation removed:
    `...` (more flags), `[--optional VALUE]` brackets, `A|B` alternatives (the first is kept) and
    one-letter placeholders for numbers."""
    words = []
    for word in shlex.split(command)[1:]:
        if word == "...":
            continue
        word = word.strip("[]")
        if re.fullmatch(r"[A-Z]{1,2}", word):  # a placeholder for a number (N, K, S, R)
            word = "2"
        if word.startswith("--") or "|" not in word or word.startswith("/"):
            words.append(word)
        else:
            words.append(word.split("|")[0])
    return words


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from _subparsers(sub, (*path, name))
                else:
                    yield (*path, name), sub


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 20


@pytest.mark.parametrize("command", readme_commands())
def test_every_command_of_the_readme_parses(command):
    try:
        build_parser().parse_args(_tokens(command))
    except SystemExit:
        pytest.fail(f"the README's `{command}` does not parse with the CLI")


def test_every_flag_the_readme_names_exists():
    known = {flag for _, sub in _subparsers(build_parser()) for a in sub._actions for flag in a.option_strings}
    named = set()
    for line in README.read_text().splitlines():
        if any(re.search(rf"(^|\s|`){tool}\s", line) for tool in NOT_OURS):
            continue
        named |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line))
    assert named - known == set()


def test_every_flag_has_its_variable():
    missing = []
    for path, sub in _subparsers(build_parser()):
        for action in sub._actions:
            long = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
            if not long or long[0] in ("--help", "--help-all"):
                continue
            variable = "SWARM_" + long[0][2:].replace("-", "_").upper()
            shown = getattr(action, "full_help", action.help)  # `swarm peer --help` hides most: --help-all
            if f"[env {variable}]" not in " ".join((shown or "").split()):
                missing.append(f"swarm {' '.join(path)} {long[0]} ({variable})")
    assert missing == []
