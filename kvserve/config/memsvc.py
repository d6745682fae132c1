"""`MemsvcConfig`: the frozen configuration of one memsvc process (`kvserve memsvc`, the
[memsvc] table, KVSERVE_* variables).

Range checks only: turning it into a pool layout reads model files and lives with memsvc
(kvserve/memsvc/shape.py). This module knows nothing about sockets, trees or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError, flag_name, option, parse_size
from kvserve.config.checks import (
    check_address,
    check_at_least,
    check_kv_events,
    check_port,
    check_positive,
    is_loopback_tcp,
)
from kvserve.config.devices import check_device, check_dtype

# the names kvserve.memsvc.policy registers (a test keeps the two in step)
POLICY_NAMES = ("optimistic", "reserve")


@dataclass(frozen=True, slots=True)
class MemsvcConfig:
    """Flags of `kvserve memsvc` (also [memsvc] in the TOML file and KVSERVE_* variables)."""

    model: str | None = option(None, help="model (.gguf or HF dir) whose KV layout to serve; "
                                          "default: the embedded model")
    n_layers: int | None = option(None, help="layers of an explicit layout (with --n-kv-heads, "
                                             "--head-dim; instead of --model)")
    n_kv_heads: int | None = option(None, help="KV heads of an explicit layout (with --n-layers)")
    head_dim: int | None = option(None, help="head dimension of an explicit layout (with --n-layers)")
    dtype: str = option("float32", help="KV dtype: float32, bfloat16, float16 or auto (bf16 on "
                                        "CUDA or CPUs with native bf16); the runners must match")
    kv_tokens: int | None = option(None, help="pool size in tokens (default: 16384 unless "
                                              "--kv-memory is given)")
    kv_memory: str | None = option(None, help="pool size in bytes, e.g. 2GiB (instead of --kv-tokens)")
    max_reqs: int = option(256, help="rows of the request-to-token table (requests held at once)")
    max_context_len: int | None = option(None, help="longest context of one request "
                                                    "(default: the model's, at most 8192)")
    policy: str = option("reserve", help="admission policy: reserve (prompt + max_new_tokens) | "
                                         "optimistic (prompt + a chunk, preempt when full)")
    page_size: int = option(1, help="slots per page (a power of two)")
    grow_chunk: int = option(64, help="slots a request grows by at a time")
    address: str | None = option(None, help="ipc://PATH or tcp://127.0.0.1:PORT "
                                            "(default: ipc://<runtime dir>/memsvc.sock)")
    metrics_port: int = option(9401, help="Prometheus port (0 = off)")
    metrics_host: str = option("127.0.0.1", help="address the metrics port binds to")
    device: str = option("cpu", help="where the pool lives: cpu, cuda, cuda:N or auto")
    lease_timeout_s: float = option(1.5, help="seconds a runner's lease lives without a step message "
                                              "or heartbeat (its TTL; the runner stops writing KV then)")
    lease_grace_s: float = option(0.5, help="seconds past a lease's TTL before memsvc reclaims it")
    reclaim_quarantine_s: float = option(2.0, help="seconds an expired lease's slots stay out of use "
                                                   "after the reclaim when memsvc cannot watch its process "
                                                   "(a remote runner; longer than one layer's step); a local "
                                                   "runner's stay out until it exits or attaches again")
    runtime_dir: str | None = option(None, help="directory of ipc sockets "
                                                "(default: kvserve.paths.runtime_dir())")
    allow_remote: bool = option(False, help="allow a tcp:// --address that is not loopback "
                                            "(runners still need an allowed CURVE key)")
    curve_secret_key_file: str = option("", help="memsvc's CURVE secret key (NAME.key_secret from "
                                                 "`kvserve keygen`, mode 0600); with "
                                                 "--curve-public-keys-dir, required for a tcp:// --address")
    curve_public_keys_dir: str = option("", help="directory of the public keys (*.key) of the runners "
                                                 "allowed to attach over CURVE; no one else gets an answer")
    integrity_interval_s: float = option(1.0, help="seconds between invariant checks while idle")
    kv_events_endpoint: str = option("", help="tcp://HOST:PORT of the ZMQ PUB socket publishing KV-cache "
                                              "events in vLLM's format for routers ('' = off; loopback "
                                              "unless --allow-remote; a concrete host, not * or 0.0.0.0)")
    kv_events_replay_endpoint: str = option("", help="tcp://HOST:PORT of the ROUTER socket replaying "
                                                     "buffered KV-cache events (with --kv-events-endpoint)")
    kv_event_block_size: int = option(16, help="tokens per block in the KV-cache events (the router's "
                                               "--kv-event-block-size) and in the host and disk tiers")
    host_cache_bytes: str = option("0", help="bytes of host RAM below the pool for KV blocks it evicts "
                                              "(a size such as 8GiB; 0 = off)")
    disk_cache_dir: str = option("", help="directory of the disk tier: KV blocks written through as they "
                                          "are cached, read back on a hit, kept across restarts ('' = off)")
    disk_cache_bytes: str = option("16GiB", help="bound of the disk tier (with --disk-cache-dir)")
    kv_events_plaintext: bool = option(False, help="publish KV-cache events on a non-loopback endpoint without "
                                                   "CURVE (vllm-router 0.1.17 has no CURVE client); they carry "
                                                   "prompt token ids: fence their ports to the router")

    @property
    def kv_events_remote(self) -> bool:
        """KV events are published and one of their endpoints is not loopback."""
        return bool(self.kv_events_endpoint) and not (
            is_loopback_tcp(self.kv_events_endpoint) and is_loopback_tcp(self.kv_events_replay_endpoint))

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_device(self.device)
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"--policy: {self.policy!r} is not one of {', '.join(POLICY_NAMES)}")
        check_at_least(self, 1, "n_layers", "n_kv_heads", "head_dim", "kv_tokens", "max_context_len",
                       "max_reqs", "grow_chunk")
        explicit = [self.n_layers, self.n_kv_heads, self.head_dim]
        if any(v is not None for v in explicit) and None in explicit:
            raise ConfigError("--n-layers, --n-kv-heads and --head-dim go together (or use --model)")
        if self.kv_tokens is not None and self.kv_memory is not None:
            raise ConfigError("give --kv-tokens or --kv-memory, not both")
        if self.kv_memory is not None:
            parse_size(self.kv_memory)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"--page-size: must be a power of two >= 1, got {self.page_size}")
        check_port("metrics_port", self.metrics_port, allow_zero=True)
        check_positive(self, "lease_timeout_s", "lease_grace_s", "reclaim_quarantine_s",
                       "integrity_interval_s")
        if self.address is not None:
            check_address(self.address, name="address", allow_remote=self.allow_remote)
        check_kv_events(self.kv_events_endpoint, self.kv_events_replay_endpoint, self.kv_event_block_size,
                        allow_remote=self.allow_remote)
        if self.kv_events_remote and not self.kv_events_plaintext and not self.curve_secret_key_file:
            name = next(n for n in ("kv_events_endpoint", "kv_events_replay_endpoint")
                        if not is_loopback_tcp(getattr(self, n)))
            raise ConfigError(
                f"{flag_name(name)}: {getattr(self, name)} is not loopback and KV events carry prompt token "
                "ids: give --curve-secret-key-file and --curve-public-keys-dir (events over CURVE), "
                "or --kv-events-plaintext with the ports fenced to the router (vllm-router 0.1.17 "
                "has no CURVE client)")
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            try:
                parse_size(getattr(self, name))
            except ConfigError as exc:
                raise ConfigError(f"{flag_name(name)}: {exc}") from None
        if self.disk_cache_dir and self.n_layers is not None:
            raise ConfigError("--disk-cache-dir keys its blocks by the model file's hash: give --model, "
                              "not an explicit layout")
        if self.kv_event_block_size % self.page_size:
            # the cache matches whole pages: a block inside a page could be announced twice
            raise ConfigError(f"--kv-event-block-size {self.kv_event_block_size}: must be a multiple of "
                              f"--page-size {self.page_size}")
