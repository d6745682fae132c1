"""The config chain every process uses: frozen dataclass < TOML < KVSERVE_* env < flags.

Each process owns one frozen config dataclass (memsvc: `MemsvcConfig`, runner:
`RunnerConfig`, frontend: `FrontendConfig`, serve: `ServeConfig`), each field declared
with `option(default, help=...)` so that its help text sits beside it. This module fills
one from, in rising order of precedence: the dataclass defaults, a TOML file (its
``[section]`` table), ``KVSERVE_<FIELD>`` environment variables, and explicit CLI values;
it turns the dataclass into argparse flags (`add_dataclass_flags`) and a config back into
the flags that rebuild it (`to_flags`, how `kvserve serve` hands each child its config).

A bad value raises `ConfigError` naming the source and the field; CLIs turn that into
exit status 2. Standard library only: no process may pay for another's imports here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")

ENV_PREFIX = "KVSERVE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}


class ConfigError(ValueError):
    """A config value that is missing, of the wrong type, or out of range."""


def option(default: Any = dataclasses.MISSING, *, help: str,
           factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its help text beside it (`factory` for a default_factory)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def help_of(f: dataclasses.Field) -> str:
    """The help text `option` stored on a field (its name in words when there is none)."""
    return f.metadata.get("help", f.name.replace("_", " "))


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (None when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def flag_name(name: str) -> str:
    """``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + name.replace("_", "-")


def setting_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """{name: (field, type)} of the plain settings of `cls` (nested config dataclasses left out)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(hints[f.name])}


def parse_size(text: str) -> int:
    """Parse a byte size such as ``2GiB``, ``512MB`` or ``1048576``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` (from TOML, the environment or a flag) as type `tp`; ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
            return None
        return coerce(value, args[0], where)
    if origin is tuple or origin is list:
        (item,) = typing.get_args(tp)[:1] or (str,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        out = [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
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
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
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


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed TOML file at `path`; ConfigError naming the file when it is missing or bad."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def table_values(data: Mapping[str, Any], path: str | os.PathLike, section: str,
                 hints: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[section]`` table of a parsed file, coerced to `hints` (name -> type); an unknown
    key is a ConfigError naming the file, the table and the key."""
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [{section}] is not a table")
    values: dict[str, Any] = {}
    for key, val in table.items():
        name = key.replace("-", "_")
        if name not in hints:
            raise ConfigError(f"config file {path}: [{section}] unknown key {key!r}")
        values[name] = coerce(val, hints[name], f"config file {path}: [{section}] {key}")
    return values


def env_values(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """The settings of `cls` that ``KVSERVE_<FIELD>`` variables in `env` set."""
    values: dict[str, Any] = {}
    for name, (_, tp) in setting_fields(cls).items():
        var = ENV_PREFIX + name.upper()
        if var in env:
            values[name] = coerce(env[var], tp, f"environment {var}")
    return values


def flag_values(cls: type, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The explicit values among `overrides` (None = not given) that name settings of `cls`."""
    fields = setting_fields(cls)
    return {name: coerce(val, fields[name][1], flag_name(name))
            for name, val in (overrides or {}).items() if val is not None and name in fields}


def build(cls: type[C], values: Mapping[str, Any]) -> C:
    """`cls(**values)`, its range checks (TypeError/ValueError) turned into ConfigError."""
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def load_config(
    cls: type[C],
    *,
    section: str,
    toml_path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Build `cls` from defaults < TOML ``[section]`` < KVSERVE_* env < `overrides`.

    `overrides` holds only values the user gave explicitly (None means "not given"). The
    file is `toml_path`, else $KVSERVE_CONFIG. The dataclass's ``__post_init__`` may raise
    ConfigError/ValueError for range checks.
    """
    env = os.environ if env is None else env
    toml_path = toml_path or env.get(CONFIG_ENV) or None
    values: dict[str, Any] = {}
    if toml_path:
        hints = {name: tp for name, (_, tp) in setting_fields(cls).items()}
        values |= table_values(read_toml(toml_path), toml_path, section, hints)
    values |= env_values(cls, env)
    values |= flag_values(cls, overrides)
    return build(cls, values)


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, tp: Any, *,
             help: str, default: Any) -> None:
    """One ``--name`` flag (``--name/--no-name`` for a bool) whose argparse default is None,
    so that "not given" stays distinguishable; the help shows `default` (a None default is
    for the help text itself to explain)."""
    text = help if default is None else f"{help} (default: {repr(default) if default == '' else default})"
    if tp is bool:
        parser.add_argument(flag_name(name), dest=name, default=None,
                            action=argparse.BooleanOptionalAction, help=text)
    else:
        parser.add_argument(flag_name(name), dest=name, default=None, metavar=name.upper(), help=text)


def process_parser(prog: str, description: str, cls: type, section: str) -> argparse.ArgumentParser:
    """The command line of one process: ``--config FILE`` (its ``[section]`` table) and one
    flag per field of `cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, help=f"TOML file with a [{section}] table "
                                                       f"(default: ${CONFIG_ENV})")
    add_dataclass_flags(parser, cls)
    return parser


def add_dataclass_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: Iterable[str] = (),
) -> None:
    """Add one ``--field-name`` flag per setting of `cls`, help and default from its field."""
    skip = set(skip)
    for name, (f, tp) in setting_fields(cls).items():
        if name not in skip:
            add_flag(parser, name, tp, help=help_of(f), default=default_of(f))


def config_from_args(cls: type[C], args: argparse.Namespace, *, section: str,
                     toml_path: str | None = None) -> C:
    """`load_config` with overrides taken from an argparse namespace."""
    names = {f.name for f in dataclasses.fields(cls)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return load_config(cls, section=section, toml_path=toml_path, overrides=overrides)


def _flag_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ",".join(_flag_text(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def to_flags(cfg: Any, *, always: Iterable[str] = ()) -> list[str]:
    """The flags that rebuild `cfg` on top of its class defaults: ``--name=value`` for every
    setting that differs from its default, and for those named in `always`."""
    always = set(always)
    out: list[str] = []
    for name, (f, tp) in setting_fields(type(cfg)).items():
        value = getattr(cfg, name)
        if name not in always and value == default_of(f):
            continue
        if tp is bool:
            out.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        else:
            out.append(f"{flag_name(name)}={_flag_text(value)}")
    return out
