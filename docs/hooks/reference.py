"""The command reference, generated at build time from the config dataclasses (process/config.py).

An MkDocs hook: `on_files` adds one page per command (`reference/<command>.md`) and an index
(`reference/index.md`) to the site, written from each command's config dataclass (its sections,
leaf options, defaults, choices and help texts) and from `swarm.cli.build_parser()` (the command's
one-line help, its positional arguments and the flags every role has). Nothing is written into
docs/, so the pages cannot go stale. `COMMANDS` maps each command to its config; the build fails
when the CLI has a command missing here, or a command's flags differ from what its config derives.

Run as a script, it writes the same pages to a folder: `python docs/hooks/reference.py OUT_DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import typing
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout's code, not whatever an editable install points at
    sys.path.insert(0, str(ROOT))

# command words -> "module:ConfigClass", in the order of the reference's index
COMMANDS: dict[tuple[str, ...], str] = {
    ("demo",): "swarm.demo:DemoConfig",
    ("dht",): "swarm.bootstrap:BootstrapConfig",
    ("peer",): "peers.config:PeerConfig",
    ("train",): "swarm.trainer.config:TrainerConfig",
    ("eval",): "swarm.evaluate:EvalConfig",
    ("status",): "swarm.status:StatusConfig",
    ("data", "prepare"): "swarm.data.prepare:PrepareConfig",
    ("export",): "swarm.export.config:ExportConfig",
    ("generate",): "swarm.generate:GenerateConfig",
    ("profile",): "swarm.profile_cli:ProfileConfig",
    ("plan",): "swarm.planner.plan_config:PlanConfig",
    ("monitor", "targets"): "swarm.monitor:MonitorConfig",
    ("run", "create"): "swarm.run_authority:RunCreateConfig",
    ("run", "update"): "swarm.run_authority:RunUpdateConfig",
    ("run", "issue"): "swarm.run_authority:RunIssueConfig",
}


class ReferenceError(RuntimeError):
    """The CLI and COMMANDS disagree: the message says what to add or change."""


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, sub-parser, one-line help) of every command that takes flags."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from leaf_parsers(sub, (*path, name))
                else:
                    yield (*path, name), sub, helps.get(name) or ""


def config_class(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def flag_of(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value is None or value == "" or value == []:
        return "—"
    if isinstance(value, list | tuple):
        return "`" + " ".join(str(v) for v in value) + "`"
    return f"`{value}`"


def _type_text(annotation: typing.Any, field: dataclasses.Field) -> str:
    from process.config import _base_type

    kind, is_list, _ = _base_type(annotation)
    if field.metadata.get("choices"):
        text = " \\| ".join(f"`{c}`" for c in field.metadata["choices"])
    elif kind is bool:
        return "flag"
    else:
        text = getattr(kind, "__name__", str(kind)).replace("Path", "path")
    return f"{text} ..." if is_list else text


def _sentence(text: str) -> str:
    text = _cell(text)
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _groups(cls: type) -> list[tuple[str, str, type]]:
    """(section name, its help, its class) of cls and every nested section, depth first; the
    command's own options come first under the name ""."""
    from process.config import _section_class

    found = [("", "", cls)]
    for field in dataclasses.fields(cls):
        inner = _section_class(field) if field.init else None
        if inner is not None:
            found += [
                (name or field.name, text or field.metadata.get("help", ""), sub) for name, text, sub in _groups(inner)
            ]
    return found


def details_pages() -> dict[str, str]:
    """`--flag` -> the page (relative to reference/) whose "Options in detail" gives its whole text,
    where `--help` gives one sentence."""
    found = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        if "\n## Options in detail\n" not in text:
            continue
        section = text.split("\n## Options in detail\n", 1)[1].split("\n## ", 1)[0]
        link = "../" + page.relative_to(ROOT / "docs").as_posix() + "#options-in-detail"
        for line in section.splitlines():
            if line.startswith("- `--"):
                found[line[3:].split("`", 1)[0]] = link
    return found


def command_page(words: tuple[str, ...], sub: argparse.ArgumentParser, summary: str, cls: type) -> str:
    """The markdown page of one command."""
    from process.config import _section_class, options

    command = "swarm " + " ".join(words)
    actions = {s: a for a in sub._actions for s in a.option_strings}
    derived = {flag_of(f.name) for _, f, _ in options(cls)}
    lines = [f"# {command}", "", _sentence(summary), ""]
    if sub.description and sub.description.rstrip(".") != summary.rstrip("."):
        lines += [_cell(sub.description), ""]
    positionals = [a for a in sub._actions if not a.option_strings and a.help != argparse.SUPPRESS]
    usage = " ".join([command, *[f"{a.metavar or a.dest.upper()}..." for a in positionals], "[OPTIONS]"])
    lines += ["```", usage, "```", ""]
    lines += [
        "Every option can also be set by its environment variable; a flag on the command line wins over "
        "the variable, and the variable over the default. A flag shown as `--x / --no-x` is switched on "
        "or off.",
        "",
    ]
    if positionals:
        lines += ["## Arguments", "", "| argument | what it is |", "|---|---|"]
        lines += [f"| `{a.metavar or a.dest}` | {_cell(a.help or '')} |" for a in positionals]
        lines.append("")
    hints_cache: dict[type, dict] = {}
    details = details_pages()
    for name, section_help, section_cls in _groups(cls):
        hints = hints_cache.setdefault(section_cls, typing.get_type_hints(section_cls))
        rows = []
        for field in dataclasses.fields(section_cls):
            if not field.init or _section_class(field) is not None:
                continue
            flag = flag_of(field.name)
            action = actions.get(flag)
            if action is None:  # an option the CLI takes another way (a positional argument)
                continue
            env = "SWARM_" + field.name.upper()
            shown = f"`{flag}`" + (f" / `--no-{flag[2:]}`" if f"--no-{flag[2:]}" in actions else "")
            hidden = " *(not in `--help`)*" if action.help == argparse.SUPPRESS else ""
            hidden += f" [In full]({details[flag]})." if flag in details else ""
            rows.append(
                f"| {shown} | `{env}` | {_type_text(hints[field.name], field)} | {_default_text(field)} | "
                f"{_cell(field.metadata.get('help', ''))}{hidden} |"
            )
        if not rows:
            continue
        lines += [f"## {name}" if name else "## Options", ""]
        if section_help:
            lines += [_sentence(section_help), ""]
        lines += ["| flag | variable | type | default | what it does |", "|---|---|---|---|---|", *rows, ""]
    extra = [
        a
        for a in sub._actions
        if a.option_strings and a.option_strings[0] not in derived and "--help" not in a.option_strings
    ]
    if extra:
        lines += ["## Every role", "", "| flag | what it does |", "|---|---|"]
        lines += [f"| {' / '.join(f'`{s}`' for s in a.option_strings)} | {_cell(a.help or '')} |" for a in extra]
        lines.append("")
    lines += [f"*Generated from `{cls.__module__}.{cls.__name__}` by `docs/hooks/reference.py`.*", ""]
    return "\n".join(lines)


def page_name(words: tuple[str, ...]) -> str:
    return "reference/" + "-".join(words) + ".md"


def check_commands(parser: argparse.ArgumentParser) -> None:
    """Refuse a CLI whose commands or flags COMMANDS does not describe."""
    from process.config import options
    from swarm.cli import PROCESS_FLAGS

    problems = []
    found = {words: sub for words, sub, _ in leaf_parsers(parser)}
    for words in sorted(set(found) - set(COMMANDS)):
        problems.append(f"`swarm {' '.join(words)}` has no entry in COMMANDS (docs/hooks/reference.py): add its config")
    for words in sorted(set(COMMANDS) - set(found)):
        problems.append(f"COMMANDS names `swarm {' '.join(words)}`, which the CLI no longer has: remove it")
    for words in sorted(set(found) & set(COMMANDS)):
        sub, cls = found[words], config_class(COMMANDS[words])
        flags = {a.option_strings[0] for a in sub._actions if a.option_strings} - {"-h"} - PROCESS_FLAGS
        positional = {a.dest for a in sub._actions if not a.option_strings}
        derived = {flag_of(f.name) for _, f, _ in options(cls) if f.name not in positional}
        if flags != derived:
            problems.append(
                f"`swarm {' '.join(words)}`'s flags differ from {cls.__name__}'s options: "
                f"only in the CLI {sorted(flags - derived)}, only in the config {sorted(derived - flags)}"
            )
    if problems:
        raise ReferenceError("; ".join(problems))


def reference_pages() -> dict[str, str]:
    """page path (under docs/) -> markdown, for every command and the index."""
    with warnings.catch_warnings():  # what importing torch and hivemind says is not the docs' business
        warnings.simplefilter("ignore", DeprecationWarning)
        from swarm.cli import build_parser

    parser = build_parser()
    check_commands(parser)
    subs = {words: (sub, summary) for words, sub, summary in leaf_parsers(parser)}
    pages = {}
    index = [
        "# Command reference",
        "",
        "Every command of the `swarm` program, with every flag, its environment variable and its default. "
        "These pages are generated from the configuration dataclasses when the site is built, so they "
        "always match the code; `swarm COMMAND --help` prints the same options.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for words, spec in COMMANDS.items():
        sub, summary = subs[words]
        name = page_name(words)
        pages[name] = command_page(words, sub, summary, config_class(spec))
        index.append(f"| [`swarm {' '.join(words)}`]({Path(name).name}) | {_cell(summary)} |")
    pages["reference/index.md"] = "\n".join([*index, ""])
    return pages


def on_files(files, config):  # the MkDocs hook
    from mkdocs.structure.files import File

    for path, content in reference_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/hooks/reference.py OUT_DIR")
    for path, content in reference_pages().items():
        target = Path(sys.argv[1]) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        print(target)
