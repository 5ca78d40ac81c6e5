"""What the documentation names exists: every repository path, `--flag`, `RESULTS.md` section and
markdown link in the docs (docs/, README.md and the other top-level documents), in the production
modules' docstrings and in the `--help` texts. A rename that leaves a stale reference fails here.

- paths: a path under one of the repository's folders (`peers/serving/host.py`, `swarm/trainer/`)
  or a top-level file must exist (a `*` matches as a glob);
- flags: a `--flag` must be a flag of some `swarm` command, except on lines that show another
  program's command (docker, pip, a benchmark script, ...);
- sections: a quoted name after a mention of RESULTS (`benchmarks/RESULTS.md, "Kept streams"`)
  must be part of a heading of that file or of benchmarks/results-history.md;
- links: a relative markdown link must name a file that exists (docs/'s own links and anchors are
  checked by `mkdocs build --strict` as well).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
from pathlib import Path

import pytest

from process.config import options
from swarm.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("process", "wire", "models", "dht", "peers", "swarm", "tests", "benchmarks", "monitoring", "docs", "docker")
FOLDERS += ("examples", ".ci")
TOP_FILES = ("README.md", "ARCHITECTURE.md", "SECURITY.md", "Makefile", "Dockerfile", "compose.yaml", "pyproject.toml")
# What commands write (ignored by git): named as outputs, not as files of the repository.
OUTPUTS = ("benchmarks/out/", "monitoring/targets/", "docs/reference/")
PRODUCTION = ("process", "wire", "models", "dht", "peers", "swarm")
# Lines that show another program's command: their flags are not ours.
OTHER_PROGRAMS = re.compile(
    r"(^|[\s`(])(docker|podman|buildah|pip|make|pytest|git|mkdocs|prometheus|promtool|ruff|apt-get|ip|hadolint|"
    r"python[\d.]*|\.venv/bin/python|timeout|flock)\s|benchmarks/[\w/]+\.py|docker/[\w.]+\.sh"
)
PATH = re.compile(
    r"(?<![\w./~-])((?:"
    + "|".join(re.escape(f) for f in FOLDERS)
    + r")/[\w./*-]*[\w*/]|(?:"
    + "|".join(re.escape(f) for f in TOP_FILES)
    + r")(?![\w.-]))"
)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?:-\*)?")
PLACEHOLDERS = {"--field-name"}  # process/config.py's docstring: how a field's name becomes its flag
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _reference_hook():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown_files() -> list[Path]:
    files = [ROOT / name for name in ("README.md", "ARCHITECTURE.md", "SECURITY.md")]
    return files + [ROOT / "monitoring" / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def module_docstrings() -> dict[str, str]:
    found = {}
    for folder in PRODUCTION:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = ast.get_docstring(ast.parse(path.read_text()), clean=False)
            if text:
                found[str(path.relative_to(ROOT))] = text
    return found


def help_texts() -> dict[str, str]:
    """`swarm COMMAND --flag` -> its help text, from the config dataclasses and the parser."""
    hook = _reference_hook()
    found = {}
    for words, spec in hook.COMMANDS.items():
        for _, field, _ in options(hook.config_class(spec)):
            found[f"swarm {' '.join(words)} {hook.flag_of(field.name)}"] = field.metadata.get("help", "")
    for words, sub, summary in hook.leaf_parsers(build_parser()):
        found[f"swarm {' '.join(words)}"] = f"{summary}\n{sub.description or ''}"
        for action in sub._actions:
            if action.option_strings and action.help not in (None, argparse.SUPPRESS):
                found.setdefault(f"swarm {' '.join(words)} {action.option_strings[0]}", action.help)
    return found


def sources() -> dict[str, str]:
    """Every text this test reads: name -> text."""
    texts = {str(path.relative_to(ROOT)): path.read_text() for path in markdown_files()}
    texts.update({f"{name} (docstring)": text for name, text in module_docstrings().items()})
    texts.update({f"{name} (help)": text for name, text in help_texts().items()})
    return texts


def known_flags() -> set[str]:
    hook = _reference_hook()
    flags = {"--help"}
    for _, sub, _ in hook.leaf_parsers(build_parser()):
        flags |= {s for action in sub._actions for s in action.option_strings}
    return flags


def missing_paths(text: str) -> list[str]:
    missing = []
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if path.startswith(OUTPUTS) or "{" in path:
            continue
        exists = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
        if not exists:
            missing.append(path)
    return missing


def unknown_flags(text: str, known: set[str]) -> list[str]:
    unknown = []
    for line in text.replace("\\\n", " ").splitlines():  # a command's continuation lines are the command's
        if OTHER_PROGRAMS.search(line):
            continue
        for flag in FLAG.findall(line):
            if flag.endswith("-*"):
                if not any(k.startswith(flag[:-1]) for k in known):
                    unknown.append(flag)
            elif flag not in known | PLACEHOLDERS:
                unknown.append(flag)
    return unknown


def results_headings() -> list[str]:
    """RESULTS.md holds each benchmark's current section; a section it no longer holds is in
    results-history.md under the same name, so a name resolves in either."""
    found = []
    for name in ("RESULTS.md", "results-history.md"):
        path = ROOT / "benchmarks" / name
        if path.exists():
            found += [_normal(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")]
    return found


def _normal(text: str) -> str:
    return " ".join(text.replace("`", "").replace("’", "'").lower().split())


def section_references(text: str) -> list[str]:
    """The quoted names after each mention of RESULTS, up to the end of its parenthesis or sentence."""
    names = []
    for match in re.finditer(r"RESULTS(?:\.md)?\b", text):
        tail = text[match.end() : match.end() + 400]
        tail = re.split(r"\)|\.\s|\n\s*\n", tail, maxsplit=1)[0]
        names += re.findall(r"\"([^\"]{3,})\"", tail)
    names += re.findall(r"\"([^\"]{3,})\"\s+in\s+(?:benchmarks/)?RESULTS", text)  # "Name" in benchmarks/RESULTS.md
    return [" ".join(name.split()) for name in names]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        generated = (path.parent / file).resolve().relative_to(ROOT).as_posix() in GENERATED_PAGES
        if file and not generated and not (path.parent / file).exists():
            broken.append(target)
    return broken


SOURCES = sources()
GENERATED_PAGES = {f"docs/{name}" for name in _reference_hook().reference_pages()}


def test_the_test_reads_the_docs_the_docstrings_and_the_help():
    assert any(name.startswith("docs/guides/") for name in SOURCES)
    assert sum(name.endswith("(docstring)") for name in SOURCES) > 100
    assert sum(name.endswith("(help)") for name in SOURCES) > 300


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_path_named_exists(name):
    assert missing_paths(SOURCES[name]) == []


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_flag_named_is_a_flag_of_a_command(name):
    assert unknown_flags(SOURCES[name], KNOWN_FLAGS) == []


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_results_section_named_is_a_heading_of_results(name):
    headings = results_headings()
    assert [n for n in section_references(SOURCES[name]) if not any(_normal(n) in h for h in headings)] == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_that_exists(path):
    assert broken_links(path) == []


def test_the_checks_catch_what_they_are_for():
    """Each check, on a reference that does not exist."""
    assert missing_paths("see benchmarks/RESULTS_simulate.md and `peers/serving/host.py`.") == [
        "benchmarks/RESULTS_simulate.md"
    ]
    assert missing_paths("the `swarm/trainer/` folder, `peers/*/host.py`, docs/reference/x.md") == []
    assert unknown_flags("swarm train --steps 5 --no-such-flag\npip install --no-deps x", KNOWN_FLAGS) == [
        "--no-such-flag"
    ]
    assert section_references('(benchmarks/RESULTS.md, "Kept streams" and "No such section"). "Not this"') == [
        "Kept streams",
        "No such section",
    ]
    assert any(_normal("Kept streams") in h for h in results_headings())


KNOWN_FLAGS = known_flags()


# A module's docstring states its contract; the reasoning lives in docs/design/ (GUIDE, issue #57).
DOCSTRING_MAX_LINES = 25
# `--help` is one sentence per flag; the details live in the generated reference (docs/reference/).
HELP_MAX_CHARS = 200


def test_no_production_module_docstring_runs_over_25_lines():
    lines = {name: len(text.strip().splitlines()) for name, text in module_docstrings().items()}
    assert {name: n for name, n in lines.items() if n > DOCSTRING_MAX_LINES} == {}


def test_no_help_text_of_an_option_runs_over_200_characters():
    texts = {name: " ".join(text.split()) for name, text in help_texts().items() if " --" in name}
    assert len(texts) > 300
    assert {name: len(text) for name, text in texts.items() if len(text) > HELP_MAX_CHARS} == {}
