"""Config plumbing shared by every process: frozen dataclass + TOML + KVSERVE_* env + CLI.

Each process owns one frozen config dataclass (memsvc: `MemsvcConfig`, runner:
`RunnerConfig`, frontend: `FrontendConfig`, ...). This module fills one from, in rising
order of precedence: the dataclass defaults, a TOML file (its ``[section]`` table),
``KVSERVE_<FIELD>`` environment variables, and explicit CLI values. It also turns the
dataclass into argparse flags so that CLI defaults come from the dataclass.

A bad value raises `ConfigError` naming the source and the field; CLIs turn that into
exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")

ENV_PREFIX = "KVSERVE_"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}


class ConfigError(ValueError):
    """A config value that is missing, of the wrong type, or out of range."""


def parse_size(text: str) -> int:
    """Parse a byte size such as ``2GiB``, ``512MB`` or ``1048576``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
            return None
        return _coerce(value, args[0], where)
    if origin is tuple or origin is list:
        (item,) = typing.get_args(tp)[:1] or (str,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a valid {getattr(tp, '__name__', tp)}") from None
    return value


def load_config(
    cls: type[C],
    *,
    section: str,
    toml_path: str | os.PathLike | None = None,
    env: typing.Mapping[str, str] | None = None,
    overrides: typing.Mapping[str, Any] | None = None,
) -> C:
    """Build `cls` from defaults < TOML ``[section]`` < KVSERVE_* env < `overrides`.

    `overrides` holds only values the user gave explicitly (None means "not given").
    The dataclass's ``__post_init__`` may raise ConfigError/ValueError for range checks.
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if toml_path is None:
        toml_path = env.get(ENV_PREFIX + "CONFIG") or None
    if toml_path:
        path = Path(toml_path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path}: not found") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [{section}] is not a table")
        for key, val in table.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ConfigError(f"config file {path}: [{section}] unknown key {key!r}")
            values[name] = _coerce(val, hints[name], f"{path} [{section}] {key}")
    for name in names:
        var = ENV_PREFIX + name.upper()
        if var in env:
            values[name] = _coerce(env[var], hints[name], f"environment {var}")
    for name, val in (overrides or {}).items():
        if val is None or name not in names:
            continue
        values[name] = _coerce(val, hints[name], f"--{name.replace('_', '-')}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    help: typing.Mapping[str, str] | None = None,
    skip: typing.Iterable[str] = (),
) -> None:
    """Add one ``--field-name`` flag per dataclass field, default shown from the dataclass.

    Flags default to None so that `load_config` can tell "not given" from a value; the
    help text shows the dataclass default. Help strings come from `help` (field -> text).
    """
    hints = typing.get_type_hints(cls)
    help = help or {}
    skip = set(skip)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        )
        text = help.get(f.name, f.name.replace("_", " "))
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            parser.add_argument(
                flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                help=f"{text} (default: {default})",
            )
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                                help=f"{text} (default: {default})")


def config_from_args(cls: type[C], args: argparse.Namespace, *, section: str,
                     toml_path: str | None = None) -> C:
    """`load_config` with overrides taken from an argparse namespace."""
    names = {f.name for f in dataclasses.fields(cls)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return load_config(cls, section=section, toml_path=toml_path, overrides=overrides)
