"""Configuration dataclasses -> command-line flags and environment variables, written once.

Each process kind (DHT node, peer, trainer) has one kw-only dataclass. Its fields carry their help
text in `metadata`; flags (`--field-name`) and environment variables (`SWARM_FIELD_NAME`) are
derived from the field names. Precedence: CLI flag > environment variable > dataclass default.
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
    """Add one flag per field of `cls` (except `skip`). Defaults stay None so that `from_sources`
    can tell a flag given on the command line from one left out."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or not field.init:
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


def from_sources(
    cls: type[T], args: argparse.Namespace | None = None, env: typing.Mapping[str, str] | None = None, **overrides: Any
) -> T:
    """Build `cls` from CLI args, then environment variables, then defaults. Lists in env vars are
    comma- or space-separated."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
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
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def describe(config: Any) -> str:
    """A multi-line, aligned `name = value` listing printed at start-up."""
    fields = [f for f in dataclasses.fields(config) if f.repr]
    width = max(len(f.name) for f in fields)
    lines = [f"{type(config).__name__}:"]
    for f in fields:
        lines.append(f"  {f.name.ljust(width)} = {getattr(config, f.name)!r}")
    return "\n".join(lines)
