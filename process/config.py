"""Configuration dataclasses -> command-line flags and environment variables, written once.

Each process kind (DHT node, peer, trainer, planner) has one kw-only dataclass, nested by section
(torchtitan-style): a field made with `section(SomeSettings)` holds another config dataclass, whose
own fields become flags in a help group of that name. Leaf fields carry their help text in
`metadata`; flags (`--field-name`) and environment variables (`SWARM_FIELD_NAME`) are derived from
the leaf field's name alone, so a flag keeps its name when its field moves into a section (leaf
names are unique across a config; `add_config_arguments` refuses duplicates). Precedence: CLI flag >
environment variable > dataclass default. Each section validates its own fields in
`__post_init__`; the process config checks the rules that span sections.

    @dataclasses.dataclass(kw_only=True)
    class Averaging:
        averaging_timeout_s: float = option(30.0, help="give up a round after this many seconds")

    @dataclasses.dataclass(kw_only=True)
    class PeerConfig:
        stage: int = option(0, help="pipeline stage to serve")
        averaging: Averaging = section(Averaging, help="how replicas of a stage agree")

    config = from_sources(PeerConfig, parser.parse_args())  # config.averaging.averaging_timeout_s
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "SWARM_"


class ConfigError(ValueError):
    """A configuration value a user must fix; the message says which and why."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Any = dataclasses.MISSING,
    choices: typing.Sequence[Any] | None = None,
) -> Any:
    """A dataclass field with the help text its flag and env var are documented with."""
    metadata = {"help": help, "choices": choices}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, *, help: str) -> Any:
    """A field holding a nested config dataclass (`cls`, built from its own flags)."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "section": cls})


def _section_class(field: dataclasses.Field) -> type | None:
    return field.metadata.get("section")


def options(cls: type) -> list[tuple[tuple[str, ...], dataclasses.Field, Any]]:
    """Every leaf option of `cls`, depth first: (section path, field, type annotation)."""
    found = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        inner = _section_class(field)
        if inner is not None:
            found += [((field.name, *path), f, hint) for path, f, hint in options(inner)]
        else:
            found.append(((), field, hints[field.name]))
    return found


def env_variables(cls: type) -> set[str]:
    """The SWARM_* variable of every option of `cls`, sections included."""
    return {_env_name(field.name) for _, field, _ in options(cls)}


def _base_type(annotation: Any) -> tuple[Any, bool, bool]:
    """(element type, is_list, is_optional) of a field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner, is_list, _ = _base_type(args[0])
        return inner, is_list, True
    if origin in (list, tuple, typing.Sequence):
        return typing.get_args(annotation)[0], True, False
    return annotation, False, False


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _parse_scalar(kind: Any, text: str, name: str) -> Any:
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}: expected true/false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name}: expected {kind.__name__}, got {text!r}") from None


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: typing.Collection[str] = ()) -> None:
    """Add one flag per leaf option of `cls` (except `skip`), a help group per section. Defaults stay
    None so that `from_sources` can tell a flag given on the command line from one left out."""
    seen: set[str] = set()
    for path, field, _ in options(cls):
        if field.name in seen:
            raise TypeError(f"{cls.__name__}: option {field.name!r} appears twice; leaf names must be unique")
        seen.add(field.name)
    _add_arguments(parser, cls, skip)


def _add_arguments(parser: Any, cls: type, skip: typing.Collection[str]) -> None:
    hints = typing.get_type_hints(cls)
    sections = []
    for field in dataclasses.fields(cls):
        if field.name in skip or not field.init:
            continue
        inner = _section_class(field)
        if inner is not None:
            sections.append((field, inner))
            continue
        kind, is_list, _ = _base_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{field.metadata.get('help', '')} [env {_env_name(field.name)}]"
        if field.default is not dataclasses.MISSING and field.default not in (None, ""):
            help_text += f" (default: {field.default})"
        kwargs: dict[str, Any] = dict(default=None, help=help_text, dest=field.name)
        if field.metadata.get("choices"):
            kwargs["choices"] = field.metadata["choices"]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif is_list:
            parser.add_argument(flag, nargs="*", type=kind, **kwargs)
        else:
            parser.add_argument(flag, type=kind, **kwargs)
    for field, inner in sections:  # argparse groups do not nest: a sub-section gets a group of its own
        group = getattr(parser, "_swarm_root", parser).add_argument_group(field.name, field.metadata.get("help"))
        group._swarm_root = getattr(parser, "_swarm_root", parser)
        _add_arguments(group, inner, skip)


def from_sources(
    cls: type[T], args: argparse.Namespace | None = None, env: typing.Mapping[str, str] | None = None, **overrides: Any
) -> T:
    """Build `cls` from CLI args, then environment variables, then defaults, section by section.
    Lists in env vars are comma- or space-separated. `overrides` name leaf options (or a whole
    section, by its field name) and win over both sources when not None."""
    env = os.environ if env is None else env
    try:
        return _build(cls, args, env, {k: v for k, v in overrides.items() if v is not None})
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _build(cls: type[T], args: argparse.Namespace | None, env: typing.Mapping[str, str], overrides: dict) -> T:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.name in overrides:
            values[field.name] = overrides[field.name]
            continue
        inner = _section_class(field)
        if inner is not None:
            values[field.name] = _build(inner, args, env, overrides)
            continue
        cli_value = getattr(args, field.name, None) if args is not None else None
        if cli_value is not None:
            values[field.name] = cli_value
            continue
        text = env.get(_env_name(field.name))
        if text is None:
            continue
        kind, is_list, _ = _base_type(hints[field.name])
        if is_list:
            values[field.name] = [
                _parse_scalar(kind, item, _env_name(field.name)) for item in text.replace(",", " ").split()
            ]
        else:
            values[field.name] = _parse_scalar(kind, text, _env_name(field.name))
    return cls(**values)


def describe(config: Any, indent: str = "  ") -> str:
    """A multi-line, aligned `name = value` listing printed at start-up, a block per section."""
    lines = [f"{type(config).__name__}:"]
    lines += _describe_fields(config, indent)
    return "\n".join(lines)


def _describe_fields(config: Any, indent: str) -> list[str]:
    fields = [f for f in dataclasses.fields(config) if f.repr]
    leaves = [f for f in fields if _section_class(f) is None]
    width = max((len(f.name) for f in leaves), default=0)
    lines = [f"{indent}{f.name.ljust(width)} = {getattr(config, f.name)!r}" for f in leaves]
    for f in fields:
        if _section_class(f) is not None:
            lines.append(f"{indent}{f.name}:")
            lines += _describe_fields(getattr(config, f.name), indent + "  ")
    return lines
