"""The command reference the docs site is built with (docs/hooks/reference.py): generated from the
config dataclasses, a page for every command naming every flag and variable, and a build that
fails when a command or a flag is not described."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from swarm.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_has_a_page_with_every_flag_and_variable(hook):
    pages = hook.reference_pages()
    for words, sub, _ in hook.leaf_parsers(build_parser()):
        page = pages[hook.page_name(words)]
        assert page.startswith(f"# swarm {' '.join(words)}\n")
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page, (words, flag)
            if action.option_strings and action.option_strings[0].startswith("--") and action.dest != "help":
                if action.option_strings[0] not in ("--verbose", "--help-all"):  # no variable: process flags
                    assert f"`SWARM_{action.dest.upper()}`" in page, (words, action.dest)
    assert "| [`swarm peer`](peer.md) |" in pages["reference/index.md"]
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f" {name}\n" in nav for name in pages), "every generated page is in mkdocs.yml's nav"


def test_the_defaults_and_sections_come_from_the_config(hook):
    page = hook.reference_pages()["reference/peer.md"]
    assert "## replicas" in page and "| `--averaging` | `SWARM_AVERAGING` |" in page
    assert "`sync`" in page.split("| `--averaging` |")[1].splitlines()[0]


def test_a_command_or_flag_the_reference_does_not_describe_fails_the_build(hook, monkeypatch):
    monkeypatch.delitem(hook.COMMANDS, ("peer",))
    with pytest.raises(hook.ReferenceError, match=r"`swarm peer` has no entry in COMMANDS"):
        hook.reference_pages()
    monkeypatch.setitem(hook.COMMANDS, ("peer",), "swarm.trainer.config:TrainerConfig")
    with pytest.raises(hook.ReferenceError, match=r"`swarm peer`'s flags differ from TrainerConfig's options"):
        hook.reference_pages()


def test_an_option_whose_whole_text_is_on_a_page_links_to_it(hook):
    """`--help` gives one sentence; a concept or guide page's "Options in detail" the whole text, and
    the reference row of that flag links there."""
    details = hook.details_pages()
    assert "--averaging" in details and details["--averaging"].endswith("concepts/replicas.md#options-in-detail")
    peer = hook.reference_pages()["reference/peer.md"]
    row = next(line for line in peer.splitlines() if line.startswith("| `--averaging` |"))
    assert "[In full](../concepts/replicas.md#options-in-detail)" in row
