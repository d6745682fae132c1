"""`ServeConfig`: the frozen configuration of `kvserve serve`, composed of the supervisor's own
settings and one config per child (`MemsvcConfig`, `RunnerConfig`, `FrontendConfig`).

`EXPOSED` declares, once, which child settings serve offers as its own flags and [serve]
keys (``--model``, ``--port``, ``--kv-tokens``, ...) and onto which children each maps;
their help and type come from the child's field. `load_serve_config` fills a child's
config, in rising precedence, from: its defaults under serve (device and dtype "auto"),
its own table of the file ([memsvc], [runner], [frontend]), serve's [serve] keys, the
KVSERVE_* environment, and serve's flags. What serve sets itself (addresses, runner ids,
metrics ports, the runtime dir) is applied by the supervisor on top.

Standard library only; knows nothing about processes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.config import (
    CONFIG_ENV,
    ConfigError,
    add_dataclass_flags,
    add_flag,
    build,
    coerce,
    env_values,
    flag_name,
    flag_values,
    help_of,
    option,
    read_toml,
    setting_fields,
    table_values,
)
from kvserve.config.checks import check_port, check_positive
from kvserve.config.frontend import FrontendConfig
from kvserve.config.memsvc import MemsvcConfig
from kvserve.config.runner import RunnerConfig

CHILDREN: dict[str, type] = {"memsvc": MemsvcConfig, "runner": RunnerConfig, "frontend": FrontendConfig}
MAX_RUNNERS = 64

# Child settings that are also serve's flags and [serve] keys -> the children they set. The
# first child named lends the flag its help and type.
EXPOSED: dict[str, tuple[str, ...]] = {
    "model": ("runner", "memsvc", "frontend"),
    "device": ("runner", "memsvc"),
    "dtype": ("runner", "memsvc"),
    "quantization": ("runner",),
    "batch_invariant": ("runner",),
    "host": ("frontend",),
    "port": ("frontend",),
    "http_port": ("frontend",),
    "served_model_name": ("frontend",),
    "kv_events_endpoint": ("memsvc", "frontend"),
    "kv_events_replay_endpoint": ("memsvc", "frontend"),
    "kv_event_block_size": ("memsvc", "frontend"),
    "kv_tokens": ("memsvc",),
    "policy": ("memsvc",),
    "host_cache_bytes": ("memsvc",),
    "disk_cache_dir": ("memsvc",),
    "disk_cache_bytes": ("memsvc",),
    "drain_timeout_s": ("frontend",),
    "max_message_bytes": ("frontend",),
    "max_prompt_tokens": ("frontend",),
    "max_new_tokens_cap": ("frontend",),
    "max_concurrent_streams": ("frontend",),
    "max_concurrent_rpcs": ("frontend",),
    "max_prompt_chars": ("frontend",),
    "tool_call_parser": ("frontend",),
    "tls_cert": ("frontend",),
    "tls_key": ("frontend",),
    "auth_token_file": ("frontend",),
}


def _memsvc_under_serve() -> MemsvcConfig:
    # standalone memsvc defaults to cpu/float32; under serve it resolves "auto" the way the
    # runners do, so that both sides agree without serve importing torch
    return MemsvcConfig(device="auto", dtype="auto")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `kvserve serve` needs to run memsvc, the runners and the frontend."""

    runners: int = option(1, help="number of runner workers")
    metrics_port: int = option(9400, help="metrics base port: frontend = it, memsvc = +1, "
                                          "runner i = +2+i (0 = off)")
    runtime_dir: str = option("", help="directory for the children's sockets "
                                       "('' = kvserve.paths.runtime_dir())")
    ready_timeout_s: float = option(600.0, help="seconds to wait for every child to be ready")
    max_restarts: int = option(5, help="restarts of one child within --restart-window-s before "
                                       "serve gives up (exit 1)")
    restart_window_s: float = option(60.0, help="window for --max-restarts (seconds)")
    memsvc: MemsvcConfig = option(help="memsvc's settings ([memsvc])", factory=_memsvc_under_serve)
    runner: RunnerConfig = option(help="every runner's settings ([runner])", factory=RunnerConfig)
    frontend: FrontendConfig = option(help="the frontend's settings ([frontend])", factory=FrontendConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.runners <= MAX_RUNNERS:
            raise ConfigError(f"--runners: must be in 1..{MAX_RUNNERS}, got {self.runners}")
        check_port("metrics_port", self.metrics_port, allow_zero=True)
        if self.metrics_port and self.metrics_port + 2 + self.runners > 65536:
            raise ConfigError(f"--metrics-port: {self.metrics_port} leaves no room for {self.runners} runners")
        check_port("port", self.frontend.port, allow_zero=False)  # serve polls it for liveness
        check_positive(self, "ready_timeout_s", "restart_window_s")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts: must be >= 0, got {self.max_restarts}")
        if self.memsvc.dtype != self.runner.dtype:
            raise ConfigError(f"--dtype: [memsvc] dtype {self.memsvc.dtype!r} and [runner] dtype "
                              f"{self.runner.dtype!r} differ; memsvc and the runners need one dtype")
        models = {"memsvc": self.memsvc.model or "", "runner": self.runner.model}
        if not self.frontend.tokenizer:
            models["frontend"] = self.frontend.model
        if len(set(models.values())) > 1:
            raise ConfigError("--model: the children's models differ ("
                              + ", ".join(f"[{k}] {v!r}" for k, v in models.items()) + ")")

    def child_metrics_port(self, role: str, index: int = 0) -> int:
        """Metrics port of one child: frontend base, memsvc base+1, runner i base+2+i (0 = off)."""
        if not self.metrics_port:
            return 0
        offsets = {"frontend": 0, "memsvc": 1, "runner": 2 + index}
        return self.metrics_port + offsets[role]


def exposed_field(name: str) -> tuple[Any, Any]:
    """(field, type) of the child setting that lends serve's `name` its help and type."""
    return setting_fields(CHILDREN[EXPOSED[name][0]])[name]


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """serve's own flags, then one flag per `EXPOSED` child setting (default: under serve)."""
    add_dataclass_flags(parser, ServeConfig)
    group = parser.add_argument_group("settings handed to the children")
    defaults = ServeConfig()
    for name, targets in EXPOSED.items():
        f, tp = exposed_field(name)
        add_flag(group, name, tp, help=f"[{', '.join(targets)}] {help_of(f)}",
                 default=getattr(getattr(defaults, targets[0]), name))


# serve's values that mean "the child's own default" (as `kvserve serve` has always taken them)
CHILD_DEFAULT: dict[str, Any] = {"kv_tokens": 0, "policy": ""}


def _set(names: list[str], given: Mapping[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    """The values of `names` in `given`, coerced to the child's types; CHILD_DEFAULT ones left out."""
    out = {}
    for name in names:
        if name in given:
            value = coerce(given[name], fields[name][1], f"{where}{name}" if where else flag_name(name))
            if name not in CHILD_DEFAULT or value != CHILD_DEFAULT[name]:
                out[name] = value
    return out


def load_serve_config(*, toml_path: str | os.PathLike | None = None,
                      env: Mapping[str, str] | None = None,
                      flags: Mapping[str, Any] | None = None) -> ServeConfig:
    """Build the whole `ServeConfig`; ConfigError names the file, table, variable or flag.

    `flags` holds serve's flags by name (None = not given); the file is `toml_path`, else
    $KVSERVE_CONFIG.
    """
    env = os.environ if env is None else env
    toml_path = toml_path or env.get(CONFIG_ENV) or None
    data = read_toml(toml_path) if toml_path else {}
    own = setting_fields(ServeConfig)
    hints = {name: tp for name, (_, tp) in own.items()} | {name: exposed_field(name)[1] for name in EXPOSED}
    serve_table = table_values(data, toml_path, "serve", hints) if toml_path else {}
    given = {name: val for name, val in (flags or {}).items() if val is not None and name in hints}
    defaults = ServeConfig()
    children: dict[str, Any] = {}
    for section, cls in CHILDREN.items():
        fields = setting_fields(cls)
        values = {name: getattr(getattr(defaults, section), name) for name in fields}
        if toml_path:
            values |= table_values(data, toml_path, section, {n: tp for n, (_, tp) in fields.items()})
        mine = [name for name, targets in EXPOSED.items() if section in targets]
        values |= _set(mine, serve_table, fields, f"config file {toml_path}: [serve] ")
        values |= env_values(cls, env)
        values |= _set(mine, given, fields, "")
        try:
            children[section] = build(cls, values)
        except ConfigError as exc:
            raise ConfigError(f"{section} settings: {exc}") from None
    values = {name: val for name, val in serve_table.items() if name in own}
    values |= env_values(ServeConfig, env)
    values |= flag_values(ServeConfig, given)
    return build(ServeConfig, values | children)
