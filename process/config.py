"""Configuration dataclasses -> command-line flags and environment variables, written once.

Each process kind has one kw-only dataclass, nested by section: a field made with
`section(SomeSettings)` holds another config dataclass, whose fields become flags in a help group.
Leaf fields carry their help in `metadata`; the flag (`--field-name`) and the variable
(`SWARM_FIELD_NAME`) come from the leaf field's name alone (unique across a config). Precedence:
CLI flag > environment variable > dataclass default. Each section validates its own fields in
`__post_init__`; the process config checks the rules that span sections.

    config = from_sources(PeerConfig, parser.parse_args())  # config.averaging.averaging_timeout_s

`packed_section` gives a whole section as one option (`--faults slowdown=3,fail_rate=0.1`);
`given_options` says which options a user set; `brief=` shows a few flags in `--help` and the
rest behind `--help-all`.

A worked example: docs/design/process.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

import pydantic

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


def packed_section(cls: type, *, prefix: str = "", help: str) -> Any:
    """A field holding a config dataclass given as ONE option named after the field: `--NAME
    key=value,...` (and SWARM_NAME), each key a field of `cls` without `prefix` (a bare key sets a
    bool to true). For developer settings (fault injection) that a user's `--help` does not list."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "packed": (cls, prefix)})


def _section_class(field: dataclasses.Field) -> type | None:
    return field.metadata.get("section")


def _packed(field: dataclasses.Field) -> tuple[type, str] | None:
    return field.metadata.get("packed")


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
            found.append(((), field, str if _packed(field) else hints[field.name]))
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


def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    skip: typing.Collection[str] = (),
    brief: typing.Collection[str] | None = None,
) -> None:
    """Add one flag per leaf option of `cls` (except `skip`), a help group per section. Defaults stay
    None so that `from_sources` can tell a flag given on the command line from one left out.
    `brief`: the options `--help` lists; every other flag still works, and `--help-all` lists them all."""
    seen: set[str] = set()
    for path, field, _ in options(cls):
        if field.name in seen:
            raise TypeError(f"{cls.__name__}: option {field.name!r} appears twice; leaf names must be unique")
        seen.add(field.name)
    _add_arguments(parser, cls, skip)
    if brief is not None:
        _hide_all_but(parser, set(brief))


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
        flag = "--" + field.name.replace("_", "-")
        if _packed(field):
            help_text = f"{field.metadata.get('help', '')} [env {_env_name(field.name)}]"
            parser.add_argument(flag, default=None, help=help_text, dest=field.name, metavar="NAME=VALUE,...")
            continue
        kind, is_list, _ = _base_type(hints[field.name])
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


class _HelpAll(argparse.Action):
    """`--help-all`: print every flag (what `--help` hides included), then exit."""

    def __init__(self, option_strings, dest, hidden=(), **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.hidden = hidden  # (object, attribute, full value) to put back

    def __call__(self, parser, namespace, values, option_string=None):
        for owner, attribute, value in self.hidden:
            setattr(owner, attribute, value)
        parser.print_help()
        parser.exit()


def _hide_all_but(parser: argparse.ArgumentParser, shown: set[str]) -> None:
    """Hide from `--help` every config flag whose option is not in `shown` (a group left empty loses
    its heading), and add `--help-all`, which shows them all."""
    hidden = []
    for action in parser._actions:
        if action.option_strings and action.dest not in shown and action.dest != "help":
            hidden.append((action, "help", action.help))
            action.full_help = action.help  # what --help-all shows
            action.help = argparse.SUPPRESS
    for group in parser._action_groups:
        if group._group_actions and all(a.help is argparse.SUPPRESS for a in group._group_actions):
            hidden += [(group, "title", group.title), (group, "description", group.description)]
            group.title = group.description = None
    parser.add_argument("--help-all", action=_HelpAll, hidden=hidden, help="show every flag, then exit")


def given_options(cls: type, args: argparse.Namespace | None, env: typing.Mapping[str, str] | None = None) -> set[str]:
    """The options of `cls` a user set, as a flag in `args` or a SWARM_* variable in `env`."""
    env = os.environ if env is None else env
    return {
        field.name
        for _, field, _ in options(cls)
        if (args is not None and getattr(args, field.name, None) is not None) or _env_name(field.name) in env
    }


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
        packed = _packed(field)
        if packed is not None:
            text = cli_value if cli_value is not None else env.get(_env_name(field.name))
            if text is not None:
                values[field.name] = parse_packed(packed[0], text, prefix=packed[1], name=field.name)
            continue
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


def parse_packed(cls: type[T], text: str, *, prefix: str = "", name: str = "") -> T:
    """`cls` from `key=value,...` (commas or spaces between items; a bare key sets a bool to true),
    each key a field of `cls` without `prefix`. ConfigError names an unknown key or a bad value."""
    hints = typing.get_type_hints(cls)
    known = {f.name.removeprefix(prefix): f.name for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for item in text.replace(",", " ").split():
        key, has_value, value = item.partition("=")
        if key not in known:
            raise ConfigError(f"--{name.replace('_', '-')} {key!r}: not one of {', '.join(sorted(known))}")
        kind, _, _ = _base_type(hints[known[key]])
        if not has_value and kind is not bool:
            raise ConfigError(f"--{name.replace('_', '-')} {key}: give a value ({key}=...)")
        values[known[key]] = _parse_scalar(kind, value if has_value else "true", f"--{name.replace('_', '-')} {key}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def packed_text(config: Any, *, prefix: str = "") -> str:
    """The `key=value,...` text of the fields of `config` that differ from their defaults (what
    `parse_packed` reads back)."""
    parts = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.init and f.default is not dataclasses.MISSING and value != f.default:
            parts.append(f"{f.name.removeprefix(prefix)}={str(value).lower() if isinstance(value, bool) else value}")
    return ",".join(parts)


def replace_options(config: T, **values: Any) -> T:
    """A copy of `config` with the named leaf options (in whatever section) replaced, every section
    that changed validated again (dataclasses.replace runs __post_init__)."""
    if not values:
        return config
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        if not field.init:
            continue
        if _section_class(field) is not None:
            inner_names = {f.name for _, f, _ in options(_section_class(field))}
            inner = {k: v for k, v in values.items() if k in inner_names}
            if inner:
                changes[field.name] = replace_options(getattr(config, field.name), **inner)
        elif field.name in values:
            changes[field.name] = values[field.name]
    unknown = set(values) - {f.name for _, f, _ in options(type(config))}
    if unknown:
        raise TypeError(f"{type(config).__name__} has no option {', '.join(sorted(unknown))}")
    return dataclasses.replace(config, **changes)


def option_values(config: Any) -> dict[str, Any]:
    """Every leaf option of `config` by name (sections flattened; a packed section as its object)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        if not field.init:
            continue
        if _section_class(field) is not None:
            values.update(option_values(getattr(config, field.name)))
        else:
            values[field.name] = getattr(config, field.name)
    return values


def record_model(cls: type, *, exclude: typing.Collection[str] = (), name: str | None = None) -> type:
    """A strict pydantic model of the options of the config section `cls` (a record's copy of a
    section: same names, types, defaults and choices; an unknown key or a value of the wrong type is
    refused). Its `settings()` builds `cls` from it, and validating it runs `cls`'s own checks."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if not field.init or field.name in exclude or _section_class(field) or _packed(field):
            continue
        annotation = hints[field.name]
        choices = field.metadata.get("choices")
        if choices:
            _, _, optional = _base_type(annotation)
            annotation = typing.Literal[tuple(choices)]
            annotation = annotation | None if optional else annotation
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        fields[field.name] = (annotation, default)

    def settings(self):
        return cls(**self.model_dump())

    def check(self):
        try:
            self.settings()
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self

    model = pydantic.create_model(
        name or f"{cls.__name__}Record",
        __config__=pydantic.ConfigDict(extra="forbid", frozen=True, strict=True),
        __validators__={"_section_checks": pydantic.model_validator(mode="after")(check)},
        **fields,
    )
    model.settings = settings
    return model


def describe(config: Any, indent: str = "  ") -> str:
    """A multi-line, aligned `name = value` listing printed at start-up, a block per section."""
    lines = [f"{type(config).__name__}:"]
    lines += _describe_fields(config, indent)
    return "\n".join(lines)


def _describe_fields(config: Any, indent: str) -> list[str]:
    fields = [f for f in dataclasses.fields(config) if f.repr]
    leaves = [f for f in fields if _section_class(f) is None and _packed(f) is None]
    width = max((len(f.name) for f in leaves), default=0)
    lines = [f"{indent}{f.name.ljust(width)} = {getattr(config, f.name)!r}" for f in leaves]
    for f in fields:
        if _section_class(f) is not None or _packed(f) is not None:
            lines.append(f"{indent}{f.name}:")
            lines += _describe_fields(getattr(config, f.name), indent + "  ")
    return lines
