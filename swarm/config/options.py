"""Declaring settings once and reading them from flags, environment variables and a YAML file.

Each setting is a dataclass field made with `option`: the field `target_batch_size` is the flag
`--target-batch-size`, the variable `SWARM_TARGET_BATCH_SIZE` and the YAML key `target_batch_size`.
Precedence: flag, then environment, then the `--config` file, then default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, TypeVar

import yaml

from swarm.config.swarm_file import SWARM_SETTINGS

ENV_PREFIX = "SWARM_"
C = TypeVar("C")


class ConfigError(ValueError):
    """A setting that cannot be used: unknown key, wrong type, or out of range."""


def option(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    """A config field: its default, its help text, and extra argparse options (e.g. choices)."""
    kwargs: dict[str, Any] = {"metadata": {"help": help, **argparse_kwargs}}
    if isinstance(default, list):
        kwargs["default_factory"] = lambda: list(default)
    else:
        kwargs["default"] = default
    return field(**kwargs)


def _base_type(annotation: Any) -> tuple[type, bool, bool]:
    """(element type, is_optional, is_list) of a field annotation such as `list[str]` or `int | None`."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional, annotation = True, args[0]
        origin = typing.get_origin(annotation)
    if origin is list:
        return typing.get_args(annotation)[0], optional, True
    return annotation, optional, False


def _convert(value: Any, annotation: Any, source: str) -> Any:
    kind, optional, is_list = _base_type(annotation)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{source}: a value is required")
    if is_list:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{source}: expected a list, got {value!r}")
        # flags take the items apart or comma-separated, as the environment does: `--stage-blocks 3,1,2`
        items = [part for item in items for part in (item.split(",") if isinstance(item, str) else [item])]
        return [_convert(item, kind, source) for item in items if item != ""]
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{source}: expected true or false, got {value!r}")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: expected {kind.__name__}, got {value!r}") from None


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one flag per field of config class `cls`, and `--config FILE`."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file with settings (keys as the flags, with _), e.g. the swarm file an organizer publishes "
        "(examples/swarm.yaml): settings of the whole swarm that this command does not use are ignored",
    )
    for f, annotation in _fields(cls):
        kind, _, is_list = _base_type(annotation)
        meta = dict(f.metadata)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f"{meta.pop('help')} (default: {default}; env {ENV_PREFIX}{f.name.upper()})"
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text, **meta}
        if kind is bool and not is_list:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif is_list:
            parser.add_argument(flag, nargs="*", metavar=f.name.upper(), **kwargs)
        else:
            parser.add_argument(flag, metavar=kind.__name__.upper(), **kwargs)


def read_settings_file(path: str) -> dict[str, Any]:
    """The settings in a YAML file (a swarm file, say): a mapping; ConfigError if it cannot be read as one."""
    try:
        with open(path) as file:
            settings = yaml.safe_load(file) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return settings


def load_config(
    cls: type[C],
    cli: Mapping[str, Any] | argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> C:
    """Builds config `cls` from flags (only those given), environment variables and a YAML file."""
    cli = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli or {})
    environ = os.environ if environ is None else environ
    config_file = cli.pop("config", None) or config_file
    from_file = read_settings_file(config_file) if config_file else {}
    known = {f.name for f in dataclasses.fields(cls)}
    # one swarm file serves every role: a role skips the swarm's settings it has no use for, not a typo
    unknown = sorted(set(from_file) - known - set(SWARM_SETTINGS))
    if unknown:
        raise ConfigError(f"config file {config_file}: unknown settings {unknown}; known: {sorted(known)}")
    values = {}
    for f, annotation in _fields(cls):
        env_name = ENV_PREFIX + f.name.upper()
        if f.name in cli:
            values[f.name] = _convert(cli[f.name], annotation, "--" + f.name.replace("_", "-"))
        elif env_name in environ:
            values[f.name] = _convert(environ[env_name], annotation, env_name)
        elif f.name in from_file:
            values[f.name] = _convert(from_file[f.name], annotation, f"{config_file}: {f.name}")
    config = cls(**values)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config


def to_flags(config: Any) -> list[str]:
    """The CLI flags that reproduce `config` (used to launch processes with the same settings)."""
    flags = []
    for f, annotation in _fields(type(config)):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        kind, _, is_list = _base_type(annotation)
        if value is None:
            continue
        if is_list:
            flags += [flag, *map(str, value)]
        elif kind is bool:
            flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags
