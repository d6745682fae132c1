"""The Triton attention backend: store_kv, then decode or extend attention.

Same signature as `kernels.reference.attention`; knows nothing about the model.
"""

from __future__ import annotations

import torch

from kvserve.kernels.decode import decode_attention
from kvserve.kernels.extend import extend_attention
from kvserve.kernels.metadata import StepMetadata, check_attention_args
from kvserve.kernels.store_kv import store_kv


def native_decode(meta: StepMetadata) -> None:
    """None: this backend's attention is not the CPU's native kernel (see `cpu.native_decode`)."""
    return None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    sm_scale: float,
) -> torch.Tensor:
    """Store k/v ([T, Hkv, D]) at meta.out_cache_loc, then attend; returns [T, Hq, D]."""
    check_attention_args(q, k, v, meta)
    store_kv(k, v, k_cache=k_cache, v_cache=v_cache, out_cache_loc=meta.out_cache_loc)
    out = torch.empty_like(q)
    if meta.is_decode:
        return decode_attention(
            q, k_cache=k_cache, v_cache=v_cache, meta=meta, sm_scale=sm_scale, out=out
        )
    return extend_attention(q, k_cache=k_cache, v_cache=v_cache, meta=meta, sm_scale=sm_scale, out=out)


__all__ = ["attention", "decode_attention", "extend_attention", "native_decode", "store_kv"]
