"""`MemsvcConfig`: the frozen configuration of one memsvc process, and how to resolve it
into a pool layout (model file or explicit shape, pool size from tokens or bytes).

This module knows nothing about sockets, trees or tensors.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ConfigError, parse_size
from kvserve.memsvc.policy import POLICIES

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_KV_TOKENS = 16384
DEFAULT_MAX_CONTEXT = 4096


@dataclass(frozen=True, slots=True)
class MemsvcConfig:
    """Flags of `kvserve memsvc` (also [memsvc] in the TOML file and KVSERVE_* variables)."""

    model: str | None = None
    n_layers: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str = "float32"
    kv_tokens: int | None = None
    kv_memory: str | None = None
    max_reqs: int = 256
    max_context_len: int | None = None
    policy: str = "reserve"
    page_size: int = 1
    grow_chunk: int = 64
    address: str | None = None
    metrics_port: int = 9401
    metrics_host: str = "127.0.0.1"
    device: str = "cpu"
    lease_timeout_s: float = 1.5
    runtime_dir: str | None = None
    allow_remote: bool = False
    integrity_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"--dtype: {self.dtype!r} is not one of float32, float16, bfloat16")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy: {self.policy!r} is not one of {', '.join(sorted(POLICIES))}")
        for name in ("n_layers", "n_kv_heads", "head_dim", "kv_tokens", "max_context_len"):
            val = getattr(self, name)
            if val is not None and val < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {val}")
        explicit = [self.n_layers, self.n_kv_heads, self.head_dim]
        if any(v is not None for v in explicit) and None in explicit:
            raise ConfigError("--n-layers, --n-kv-heads and --head-dim go together (or use --model)")
        if self.kv_tokens is not None and self.kv_memory is not None:
            raise ConfigError("give --kv-tokens or --kv-memory, not both")
        if self.kv_memory is not None:
            parse_size(self.kv_memory)
        if self.max_reqs < 1:
            raise ConfigError(f"--max-reqs: must be >= 1, got {self.max_reqs}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"--page-size: must be a power of two >= 1, got {self.page_size}")
        if self.grow_chunk < 1:
            raise ConfigError(f"--grow-chunk: must be >= 1, got {self.grow_chunk}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port: {self.metrics_port} is not a port (0 = off)")
        if self.lease_timeout_s <= 0:
            raise ConfigError(f"--lease-timeout-s: must be > 0, got {self.lease_timeout_s}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"--device: {self.device!r} is not cpu or cuda[:N]")
        if self.address is not None:
            check_address(self.address, allow_remote=self.allow_remote)


def check_address(address: str, *, allow_remote: bool) -> None:
    """Accept ipc://PATH and tcp://HOST:PORT (loopback unless allow_remote)."""
    if address.startswith("ipc://"):
        if len(address) <= len("ipc://"):
            raise ConfigError("--address: ipc:// needs a path")
        return
    if not address.startswith("tcp://"):
        raise ConfigError(f"--address: {address!r} must start with ipc:// or tcp://")
    host, _, port = address[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not host:
        raise ConfigError(f"--address: {address!r} is not tcp://HOST:PORT")
    if allow_remote:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(f"--address: {host} is not a loopback address (use --allow-remote)")


@dataclass(frozen=True, slots=True)
class PoolShape:
    """The resolved layout memsvc allocates."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    size: int  # slots including the reserved page 0
    max_reqs: int
    max_context_len: int
    page_size: int


def resolve_shape(cfg: MemsvcConfig) -> PoolShape:
    """Read the model if needed and size the pool; ConfigError on any problem."""
    max_pos = DEFAULT_MAX_CONTEXT
    if cfg.n_layers is not None:
        n_layers, n_kv_heads, head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    else:
        from kvserve.model.files import ModelFileError, kv_shape, resolve_model

        try:
            shape = kv_shape(Path(resolve_model(cfg.model)))
        except ModelFileError as exc:
            raise ConfigError(f"--model: {exc}") from None
        n_layers, n_kv_heads, head_dim = shape.n_layers, shape.n_kv_heads, shape.head_dim
        max_pos = min(shape.max_position, 8192)
    ps = cfg.page_size
    max_ctx = cfg.max_context_len or max_pos
    max_ctx = -(-max_ctx // ps) * ps
    per_token = 2 * n_layers * n_kv_heads * head_dim * DTYPE_BYTES[cfg.dtype]
    if cfg.kv_memory is not None:
        tokens = parse_size(cfg.kv_memory) // per_token
        if tokens < ps:
            raise ConfigError(f"--kv-memory {cfg.kv_memory} holds fewer than {ps} tokens "
                              f"({per_token} bytes per token)")
    else:
        tokens = cfg.kv_tokens or DEFAULT_KV_TOKENS
    tokens = max(ps, tokens - tokens % ps)
    # one request can never hold more than the whole pool: a longer context would let a
    # request wait forever for an admission that cannot succeed
    max_ctx = min(max_ctx, tokens)
    return PoolShape(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     dtype=cfg.dtype, size=tokens + ps, max_reqs=cfg.max_reqs,
                     max_context_len=max_ctx, page_size=ps)
