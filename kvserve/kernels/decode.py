"""Triton split-KV decode attention (flash-decoding) over the token-level KV pool.

Stage 1 gives each (request, kv head, split) one program that walks its slice of the
sequence through `req_to_token`, runs an online softmax for all query heads of the group
at once, and writes a normalised partial output plus (running max, denominator) into
`decode_o_part` / `decode_ml_part`.  Stage 2 merges the splits of each (request, head)
into the output.

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
def _decode_split_kernel(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, O_part, ML_part,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh, stride_ms,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CDTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    # This split covers positions [start, end) of the request's sequence.
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, num_splits)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # The group's query heads form the M dimension of the dots: K/V are read once per group.
    q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(CDTYPE)

    # Online softmax state, in the log2 domain (qk_scale folds in log2(e)).
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        # -- gather this block's slots, then its K and V rows --
        pos = n0 + offs_n
        n_mask = pos < end
        slot = tl.load(Req_to_token + row * stride_r2t + pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(CDTYPE)
        v = tl.load(V_cache + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(CDTYPE)
        # -- scores, masked past the end of the split --
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # -- new running max; rescale what was accumulated so far --
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(CDTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Empty splits (short sequences) leave l_i == 0; the merge skips them.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = O_part + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out, mask=h_mask[:, None] & d_mask[None, :])
    ml_ptrs = ML_part + b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(ml_ptrs, tl.where(has, m_i, 0.0), mask=h_mask)
    tl.store(ml_ptrs + 1, l_i, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    O_part, ML_part, Out, num_splits,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh, stride_ms,
    stride_outb, stride_outh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (request, query head): weight each split's normalised output by its
    # share of the softmax mass, l_s * 2^(m_s - max_s m_s).
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ml_ptrs = ML_part + b * stride_mb + h * stride_mh + offs_s * stride_ms
    s_mask = offs_s < num_splits
    l_s = tl.load(ml_ptrs + 1, mask=s_mask, other=0.0)
    valid = s_mask & (l_s > 0)
    m_s = tl.where(valid, tl.load(ml_ptrs, mask=s_mask, other=0.0), float("-inf"))
    m = tl.max(m_s, 0)
    w = tl.where(valid, l_s * tl.math.exp2(m_s - m), 0.0)
    o_ptrs = O_part + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :]
    o = tl.load(o_ptrs, mask=valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_outb + h * stride_outh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    sm_scale: float,
    out: torch.Tensor,
    o_part: torch.Tensor,
    ml_part: torch.Tensor,
    num_splits: int,
) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [B, Hq, D] contiguous along D, got {tuple(q.shape)}")
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    if bsz != meta.batch_size or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit batch {meta.batch_size} / {hkv} kv heads")
    check_cache("k_cache", k_cache, hkv, d)
    check_cache("v_cache", v_cache, hkv, d)
    check_step_indices(meta, ("req_to_token", "req_pool_indices", "seq_lens"), q.device)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} contiguous along D, got {tuple(out.shape)}")
    if o_part.shape[0] < bsz or o_part.shape[1] != hq or o_part.shape[2] < num_splits \
            or o_part.shape[3] != d or o_part.stride(3) != 1:
        raise ValueError(f"decode_o_part {tuple(o_part.shape)} too small for {(bsz, hq, num_splits, d)}")
    if ml_part.shape[:3] != o_part.shape[:3] or ml_part.stride(3) != 1:
        raise ValueError(f"decode_ml_part {tuple(ml_part.shape)} does not match decode_o_part")
    group = hq // hkv
    cdtype = compute_dtype(_decode_split_kernel, q.dtype)
    block_d = block(d)
    block_n, num_warps = _split_tiles(q.dtype, block_d)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
        o_part, ml_part,
        sm_scale * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        meta.req_to_token.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        ml_part.stride(0), ml_part.stride(1), ml_part.stride(2),
        GROUP=group, HEAD_DIM=d,
        BLOCK_H=block(group), BLOCK_D=block_d, BLOCK_N=block_n,
        CDTYPE=cdtype, DOT_PRECISION=dot_precision(cdtype),
        num_warps=num_warps,
    )
    _decode_merge_kernel[(bsz, hq)](
        o_part, ml_part, out, num_splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        ml_part.stride(0), ml_part.stride(1), ml_part.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block(d, minimum=1),
    )


def _split_tiles(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """(keys per block, warps) of the split kernel for the input dtype and head-dim block.

    Chosen so that no configuration spills registers on sm_80 / sm_89 / sm_90: fp32 dots
    run on FMA units with the whole tile in registers, so fp32 takes half the keys per
    block; head dims above 64 need 8 warps to hold the tile.  ptxas's own report in
    tests/kernels/test_cuda_compile.py holds every choice to that.
    """
    if dtype == torch.float32:
        return 32, 8
    if block_d <= 64:
        return 64, 4
    return (64 if block_d <= 128 else 32), 8


def decode_attention(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    sm_scale: float,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, Hq, D], one token per request, over the whole cached sequence.

    Uses meta.decode_o_part / decode_ml_part as split buffers (allocated here if meta has
    no workspace) and writes into `out` (default: meta.decode_out[:B], or a new tensor).
    `num_kv_splits` overrides meta.num_kv_splits.
    """
    splits = num_kv_splits or meta.num_kv_splits
    bsz, hq, d = q.shape
    o_part, ml_part = meta.decode_o_part, meta.decode_ml_part
    if o_part is None or ml_part is None:
        o_part = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=q.device)
        ml_part = torch.empty(bsz, hq, splits, 2, dtype=torch.float32, device=q.device)
    if out is None:
        if meta.decode_out is not None and meta.decode_out.dtype == q.dtype:
            out = meta.decode_out[:bsz]
        else:
            out = torch.empty_like(q)
    _launch_decode(q, k_cache, v_cache, meta, sm_scale, out, o_part, ml_part, splits)
    return out
