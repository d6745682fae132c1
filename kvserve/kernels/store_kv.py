"""Triton kernel writing the new tokens' K and V into their cache slots for one layer.

Knows nothing about requests or attention; imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels._triton_common import block, check_cache, check_index


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_cache,
    V_cache,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kct,
    stride_kch,
    stride_vct,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per new token: copy its [Hkv, D] tile of K and of V to slot Loc[t].
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = K_cache + slot * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = V_cache + slot * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(dst_k, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(V_cache.dtype.element_ty), mask=mask)


def _launch_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must be equal [T, Hkv, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    t, hkv, d = k.shape
    if out_cache_loc.shape != (t,):
        raise ValueError(f"out_cache_loc must be [{t}], got {tuple(out_cache_loc.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous along head_dim")
    check_cache("k_cache", k_cache, hkv, d)
    check_cache("v_cache", v_cache, hkv, d)
    check_index("out_cache_loc", out_cache_loc, k.device)
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, out_cache_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_HEADS=hkv, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=block(d, minimum=1),
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Write k/v ([T, Hkv, D]) into k_cache/v_cache ([size, Hkv, D]) at out_cache_loc."""
    _launch_store_kv(k, v, k_cache, v_cache, out_cache_loc)
