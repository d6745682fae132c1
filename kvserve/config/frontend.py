"""Frozen configs of the gRPC frontend (`FrontendConfig`) and the `kvserve serve` supervisor
(`ServeConfig`). CLI flags take their defaults from these dataclasses (see kvserve.config).

Range checks live in ``__post_init__`` and raise ConfigError naming the field. This module
knows nothing about gRPC, ZMQ or processes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvserve.config import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def _check_port(name: str, value: int, *, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise ConfigError(f"--{name.replace('_', '-')}: {value} is not a port in {low}..65535")


def _check_positive(cfg: object, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(cfg, name)}")


def _check_runner_address(address: str, allow_remote: bool) -> None:
    """The runner link has no authentication: tcp only on loopback unless allowed."""
    if not address or address.startswith("ipc://"):
        return
    if not address.startswith("tcp://"):
        raise ConfigError(f"--frontend-address: {address!r} must start with ipc:// or tcp://")
    host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise ConfigError(f"--frontend-address: {host!r} is not a loopback address (use --allow-remote)")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Everything `kvserve frontend` needs; defaults match docs/interfaces.md."""

    model: str = ""
    tokenizer: str = ""  # "" = the model's tokenizer; "bytes" = byte-level (tests, no model)
    host: str = "127.0.0.1"
    port: int = 50051
    frontend_address: str = ""  # "" = ipc://<runtime_dir>/frontend.sock
    runtime_dir: str = ""
    metrics_port: int = 9400
    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 0  # 0 = the model's context length
    max_new_tokens_cap: int = 4096
    default_max_new_tokens: int = 128
    max_concurrent_streams: int = 256
    max_waiting: int = 256
    max_stop_strings: int = 16
    max_stop_len: int = 256
    drain_timeout_s: float = 10.0
    runner_timeout_s: float = 1.5
    tls_cert: str = ""
    tls_key: str = ""
    auth_token_file: str = ""
    allow_remote: bool = False  # allow a tcp:// runner address that is not loopback

    def __post_init__(self) -> None:
        _check_runner_address(self.frontend_address, self.allow_remote)
        _check_port("port", self.port, allow_zero=True)
        _check_port("metrics_port", self.metrics_port, allow_zero=True)
        _check_positive(
            self, "max_message_bytes", "max_new_tokens_cap", "default_max_new_tokens",
            "max_concurrent_streams", "max_waiting", "max_stop_strings", "max_stop_len",
            "drain_timeout_s", "runner_timeout_s",
        )
        if self.max_prompt_tokens < 0:
            raise ConfigError(f"--max-prompt-tokens: must be >= 0, got {self.max_prompt_tokens}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key must be given together")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `kvserve serve` needs to run memsvc, the runners and the frontend."""

    model: str = ""
    device: str = "auto"
    dtype: str = "auto"  # resolved once by serve (runner.config.resolve_dtype) for every child
    runners: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400  # frontend = this, memsvc = +1, runner i = +2+i; 0 = none
    runtime_dir: str = ""
    kv_tokens: int = 0  # 0 = memsvc's default
    policy: str = ""  # "" = memsvc's default
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 10.0
    max_message_bytes: int = 4 * 1024 * 1024  # these four: passed to the frontend, same defaults
    max_prompt_tokens: int = 0
    max_new_tokens_cap: int = 4096
    max_concurrent_streams: int = 256
    tls_cert: str = ""  # passed to the frontend
    tls_key: str = ""
    auth_token_file: str = ""
    max_restarts: int = 5  # per child within restart_window_s, then give up (exit 1)
    restart_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device: {self.device!r} is not one of {', '.join(DEVICES)} or cuda:N")
        if not 1 <= self.runners <= 64:
            raise ConfigError(f"--runners: must be in 1..64, got {self.runners}")
        _check_port("port", self.port, allow_zero=False)
        _check_port("metrics_port", self.metrics_port, allow_zero=True)
        if self.metrics_port and self.metrics_port + 2 + self.runners > 65536:
            raise ConfigError(f"--metrics-port: {self.metrics_port} leaves no room for {self.runners} runners")
        if self.kv_tokens < 0:
            raise ConfigError(f"--kv-tokens: must be >= 0, got {self.kv_tokens}")
        _check_positive(self, "ready_timeout_s", "drain_timeout_s", "restart_window_s",
                        "max_message_bytes", "max_new_tokens_cap", "max_concurrent_streams")
        if self.max_prompt_tokens < 0:
            raise ConfigError(f"--max-prompt-tokens: must be >= 0, got {self.max_prompt_tokens}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key must be given together")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts: must be >= 0, got {self.max_restarts}")

    def child_metrics_port(self, role: str, index: int = 0) -> int:
        """Metrics port of one child: frontend base, memsvc base+1, runner i base+2+i (0 = off)."""
        if not self.metrics_port:
            return 0
        offsets = {"frontend": 0, "memsvc": 1, "runner": 2 + index}
        return self.metrics_port + offsets[role]
