"""Plain-torch attention over the token-level KV pool: the CPU backend and the test oracle.

Same operations and arguments as the Triton kernels (store the new K/V at
`meta.out_cache_loc`, then attend through `req_to_token`), written for clarity and for
CPU speed: decode requests are gathered into one padded batch and attended with a length
mask; prefill chunks are attended one request at a time with a prefix+causal mask.
Softmax runs in float32 whatever the input dtype.

Knows nothing about the model, memsvc or scheduling; imports only torch.
"""

from __future__ import annotations

import torch

from kvserve.kernels.metadata import StepMetadata, check_attention_args


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into the cache slots `out_cache_loc`."""
    k_cache[out_cache_loc] = k.to(k_cache.dtype)
    v_cache[out_cache_loc] = v.to(v_cache.dtype)


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q [N, Hq, M, D], k/v [N, Hkv, L, D], mask broadcastable to [N, 1, M, L] -> [N, Hq, M, D]."""
    n, hq, m, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = q.reshape(n, hkv, group * m, d).float()
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * sm_scale
    scores = scores.view(n, hkv, group, m, -1).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(n, hkv, group * m, -1)
    out = torch.matmul(probs, v.float())
    return out.view(n, hq, m, d)


def decode_attention(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    sm_scale: float,
) -> torch.Tensor:
    """One query per decode request (q [Bd, Hq, D]) against its whole sequence in the cache.

    q holds the requests with extend_len == 1, in batch order (all of them for a pure
    decode step).  Returns [Bd, Hq, D] in q's dtype.
    """
    dense = meta.dense()
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    # Gather K/V straight into head-major [Bd, Hkv, L, D] so the matmuls need no permute.
    rows = dense.head_major_rows(hkv)
    n, _, lmax = rows.shape
    flat = rows.reshape(-1)
    k = k_cache.view(-1, d).index_select(0, flat).view(n, hkv, lmax, d)
    v = v_cache.view(-1, d).index_select(0, flat).view(n, hkv, lmax, d)
    valid = dense.key_valid[dense.decode_rows, :lmax]
    out = _sdpa_gqa(q[:, :, None, :], k, v, valid[:, None, None, :], sm_scale)
    return out[:, :, 0, :].to(q.dtype)


def extend_attention(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    sm_scale: float,
) -> torch.Tensor:
    """Ragged query tokens (q [T, Hq, D]) against cached prefix + causal self; K/V stored."""
    dense = meta.dense()
    out = torch.empty_like(q)
    qo = meta.qo_indptr.tolist()
    if dense.decode_rows.numel():
        tok = meta.qo_indptr[dense.decode_rows]
        out[tok] = decode_attention(
            q[tok], k_cache=k_cache, v_cache=v_cache, meta=meta, sm_scale=sm_scale
        )
    for b, mask in zip(dense.prefill_rows, dense.prefill_masks, strict=True):
        seq = meta.seq_lens_host[b]
        slots = dense.slots[b, :seq]
        k = k_cache.index_select(0, slots).transpose(0, 1)[None]
        v = v_cache.index_select(0, slots).transpose(0, 1)[None]
        qb = q[qo[b] : qo[b + 1]].transpose(0, 1)[None]
        ob = _sdpa_gqa(qb, k, v, mask[None, None], sm_scale)
        out[qo[b] : qo[b + 1]] = ob[0].transpose(0, 1).to(q.dtype)
    return out


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
    if meta.is_decode:
        return decode_attention(q, k_cache=k_cache, v_cache=v_cache, meta=meta, sm_scale=sm_scale)
    return extend_attention(q, k_cache=k_cache, v_cache=v_cache, meta=meta, sm_scale=sm_scale)
