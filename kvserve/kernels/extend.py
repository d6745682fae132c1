"""Triton extend (prefill-chunk) attention over the token-level KV pool.

A batch holds a ragged run of new query tokens per request.  Its query tiles are listed
by `q_tile_to_batch` / `q_tile_to_index`; one program handles one tile for one query
head.  Every key is read from the cache through `req_to_token` (the new tokens' K/V are
stored first), so the cached prefix and the new tokens form one sequence: query i of
request b (position prefix_b + i) sees positions <= prefix_b + i.

Knows nothing about scheduling or the model; imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels._triton_common import (
    LOG2E,
    block,
    check_cache,
    check_step_indices,
    compute_dtype,
    dot_precision,
)
from kvserve.kernels.metadata import StepMetadata


@triton.jit
def _extend_kernel(
    Q, K_cache, V_cache, Out,
    Req_to_token, Req_pool_indices, Prefix_lens, Extend_lens, Qo_indptr,
    Tile_to_batch, Tile_to_index,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CDTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    b = tl.load(Tile_to_batch + tile)
    tile_idx = tl.load(Tile_to_index + tile)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    prefix = tl.load(Prefix_lens + b).to(tl.int32)
    extend = tl.load(Extend_lens + b).to(tl.int32)
    qo_start = tl.load(Qo_indptr + b).to(tl.int64)

    offs_m = tile_idx * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m

    # Load the tile's queries once; they stay in registers for the whole key loop.
    q_ptrs = Q + (qo_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(CDTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys run from position 0 to the tile's last query: prefix first, then causal self.
    kv_end = prefix + tl.minimum(extend, (tile_idx + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        # -- gather the block's slots and K/V rows through req_to_token --
        pos = n0 + offs_n
        n_mask = pos < kv_end
        slot = tl.load(Req_to_token + row * stride_r2t + pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(CDTYPE)
        v = tl.load(V_cache + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(CDTYPE)
        # -- scores with the prefix + causal mask (position 0 is always visible) --
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        # -- online softmax update --
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(CDTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = Out + (qo_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _launch_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    sm_scale: float,
    out: torch.Tensor,
) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [T, Hq, D] contiguous along D, got {tuple(q.shape)}")
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if t != meta.num_tokens or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit {meta.num_tokens} tokens / {hkv} kv heads")
    check_cache("k_cache", k_cache, hkv, d)
    check_cache("v_cache", v_cache, hkv, d)
    check_step_indices(meta, ("req_to_token", "req_pool_indices", "prefix_lens", "extend_lens",
                              "qo_indptr", "q_tile_to_batch", "q_tile_to_index"), q.device)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} contiguous along D, got {tuple(out.shape)}")
    n_tiles = meta.q_tile_to_batch.numel()
    if n_tiles == 0:
        return
    cdtype = compute_dtype(_extend_kernel, q.dtype)
    block_d = block(d)
    block_n = _key_block(q.dtype, block_d)
    _extend_kernel[(n_tiles, hq)](
        q, k_cache, v_cache, out,
        meta.req_to_token, meta.req_pool_indices, meta.prefix_lens, meta.extend_lens,
        meta.qo_indptr, meta.q_tile_to_batch, meta.q_tile_to_index,
        sm_scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        meta.req_to_token.stride(0),
        GROUP=hq // hkv, HEAD_DIM=d,
        BLOCK_M=meta.block_q, BLOCK_N=block_n, BLOCK_D=block_d,
        CDTYPE=cdtype, DOT_PRECISION=dot_precision(cdtype),
        num_warps=8,
    )


def _key_block(dtype: torch.dtype, block_d: int) -> int:
    """Keys per inner-loop block for a query tile of `block_q` (64) rows and 8 warps.

    Chosen so that no configuration spills registers on sm_80/89/90 (fp32 dots run on
    FMA units and hold the whole tile in registers); tests/kernels/test_cuda_compile.py
    holds every choice to that.
    """
    if dtype == torch.float32:
        return 32 if block_d <= 64 else 16
    return 64 if block_d <= 64 else 32


def extend_attention(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Extend attention: q [T, Hq, D] (new tokens, request by request) over prefix + self.

    The new tokens' K/V must already be in the cache (see store_kv).  Returns [T, Hq, D]
    in q's dtype (written into `out` when given).
    """
    if out is None:
        out = torch.empty_like(q)
    _launch_extend(q, k_cache, v_cache, meta, sm_scale, out)
    return out
