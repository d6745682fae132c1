"""The pool layout one memsvc allocates (`PoolShape`), resolved from its `MemsvcConfig`: the
model's KV shape (read from the model file) or an explicit one, the pool size from tokens
or bytes, the longest context.

Reads model headers only (kvserve.model.files); knows nothing about sockets or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ConfigError, parse_size
from kvserve.config.memsvc import MemsvcConfig

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_KV_TOKENS = 16384
DEFAULT_MAX_CONTEXT = 4096
MAX_MODEL_CONTEXT = 8192


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
    """Read the model if needed and size the pool; ConfigError on any problem.

    `cfg.dtype` must be resolved already (kvserve.config.devices.resolve_dtype), not "auto".
    """
    if cfg.dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype: {cfg.dtype!r} must be resolved before sizing the pool")
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
        max_pos = min(shape.max_position, MAX_MODEL_CONTEXT)
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
