"""Fast plain-torch attention over the token-level KV pool: the production CPU backend.

Same contract as `reference.attention` (store the new K/V at `meta.out_cache_loc`, then
attend through `req_to_token`), built on `F.scaled_dot_product_attention` (the CPU flash
kernel) instead of hand-written matmul/softmax:

- decode: a single request whose slots are one run is read through zero-copy views;
  otherwise every decode request's K/V is gathered token-major (one `index_select` over
  [size, Hkv * D] rows) into a step-scoped buffer reused by every layer, then one SDPA call
  attends the whole batch.  The q heads of one KV group are laid out as that group's
  query rows, so no K/V is repeated for GQA; a length mask is passed only when the
  requests' lengths differ, and padding points at a real slot of the same request.
- prefill: one SDPA call per request; when its slots are one contiguous run the cache is
  read through a zero-copy view, otherwise gathered.  A fresh prompt uses `is_causal`,
  a chunk after a cached prefix an explicit prefix+causal mask.

With `StepMetadata.invariant` (the runner's default, issue 36) a step with a prompt in it
attends every token through the native kernel as a decode row of its own instead: one
token's result then depends on its position and its KV alone, not on its chunk or batch.

The per-step host plan (slots, masks, buffers) is built on first use and kept on the
`StepMetadata`.  Knows nothing about the model, memsvc or scheduling; imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kernels import native
from kvserve.kernels.metadata import StepMetadata, check_attention_args

_PLAN_KEY = "cpu"
_EVERY_KEY = "cpu-every"  # the step's `_every_token` kernel, bound once for every layer
VIEW_MAX_BATCH = 1
"""Decode batches up to this size whose requests are each one run of slots skip the gather
(measured: a per-request view loop only wins for a single request)."""


@dataclass(slots=True)
class _Prefill:
    """One request with extend_len > 1: its query rows and where its keys live."""

    q_start: int
    q_end: int
    prefix_len: int
    run_start: int | None  # first slot when the slots are one contiguous run
    slots: torch.Tensor | None  # int64 [seq] otherwise
    mask: torch.Tensor | None  # [E, seq] bool (None: fresh prompt, use is_causal)


@dataclass(slots=True)
class _Gather:
    """The torch decode path's inputs: slots to gather and the length mask."""

    slots: torch.Tensor  # int64 [Bd * Lmax] token-major, padded with own slot
    mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] bool, None when lengths are equal
    lmax: int
    runs: list[tuple[int, int]] | None  # (first slot, length) per request: view path


@dataclass(slots=True)
class _Plan:
    """Host-side plan of one step, shared by every layer."""

    decode_tokens: torch.Tensor | None  # int64 rows of q that are decode requests
    decode_rows: torch.Tensor | None  # int64 [Bd] rows of req_to_token
    decode_lens: list[int]  # sequence length of each decode request
    prefills: list[_Prefill]
    req_to_token: torch.Tensor
    gather: _Gather | None = None  # built on first use by the torch path
    native: native.DecodeAttention | None = None  # built on first use by the native path
    buffers: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    def gather_buffers(
        self, k_cache: torch.Tensor, num: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[num, row] K and V gather targets, allocated once per step and reused per layer."""
        row = k_cache.shape[1] * k_cache.shape[2]
        key = (k_cache.dtype, row)
        bufs = self.buffers.get(key)
        if bufs is None:
            make = dict(dtype=k_cache.dtype, device=k_cache.device)
            bufs = (torch.empty(num, row, **make), torch.empty(num, row, **make))
            self.buffers[key] = bufs
        return bufs


def _build_plan(meta: StepMetadata) -> _Plan:
    device = meta.req_to_token.device
    rows = meta.req_pool_indices.tolist()
    ext, pre, seq = meta.extend_lens_host, meta.prefix_lens_host, meta.seq_lens_host
    qo = meta.qo_indptr.tolist()
    r2t = meta.req_to_token
    decode = [i for i, e in enumerate(ext) if e == 1]
    prefills = []
    for i, e in enumerate(ext):
        if e == 1:
            continue
        slots = r2t[rows[i], : seq[i]].to(torch.int64)
        first = int(slots[0])
        contiguous = _is_run(slots, first)
        mask = None
        if pre[i] > 0:
            q_pos = pre[i] + torch.arange(e, device=device)
            mask = torch.arange(seq[i], device=device)[None, :] <= q_pos[:, None]
        prefills.append(
            _Prefill(qo[i], qo[i + 1], pre[i], first if contiguous else None,
                     None if contiguous else slots, mask)
        )
    if not decode:
        return _Plan(None, None, [], prefills, r2t)
    tokens = torch.tensor([qo[i] for i in decode], dtype=torch.int64, device=device)
    sel = torch.tensor([rows[i] for i in decode], dtype=torch.int64, device=device)
    return _Plan(tokens, sel, [seq[i] for i in decode], prefills, r2t)


def _gather_plan(plan: _Plan) -> _Gather:
    """The torch decode path's slots and mask (padding points at the request's own first slot)."""
    if plan.gather is not None:
        return plan.gather
    device = plan.req_to_token.device
    lens = plan.decode_lens
    lmax = max(lens)
    assert plan.decode_rows is not None
    slots = plan.req_to_token[plan.decode_rows, :lmax].to(torch.int64)
    mask = None
    if min(lens) != lmax:
        valid = torch.arange(lmax, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        slots = torch.where(valid, slots, slots[:, :1])
        mask = valid[:, None, None, :]
    runs = None
    if len(lens) <= VIEW_MAX_BATCH:
        firsts = slots[:, 0].tolist()
        if all(_is_run(slots[i, : lens[i]], f) for i, f in enumerate(firsts)):
            runs = list(zip(firsts, lens, strict=True))
    plan.gather = _Gather(slots.reshape(-1), mask, lmax, runs)
    return plan.gather


def _is_run(slots: torch.Tensor, first: int) -> bool:
    """Whether `slots` are `first, first + 1, ...` (one contiguous run of the pool)."""
    n = slots.numel()
    return int(slots[-1]) - first == n - 1 and torch.equal(
        slots, torch.arange(first, first + n, device=slots.device)
    )


def _plan(meta: StepMetadata) -> _Plan:
    plan = meta.backend_cache.get(_PLAN_KEY)
    if plan is None:
        plan = _build_plan(meta)
        meta.backend_cache[_PLAN_KEY] = plan
    return plan  # type: ignore[return-value]


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _Plan, sm_scale: float
) -> torch.Tensor:
    """q [Bd, Hq, D] -> [Bd, Hq, D]: in place through the native kernel where it runs, else
    one batched SDPA over the gathered sequences."""
    if native.supports(q, k_cache) and plan.req_to_token.dtype == torch.int32:
        if plan.native is None:  # the step's rows and lengths, checked once for every layer
            assert plan.decode_rows is not None
            plan.native = native.DecodeAttention(plan.req_to_token, plan.decode_rows,
                                                 torch.tensor(plan.decode_lens, dtype=torch.int64))
        return plan.native(q, k_cache, v_cache, sm_scale)
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    qg = q.to(k_cache.dtype).reshape(n, hkv, hq // hkv, d)
    gather = _gather_plan(plan)
    if gather.runs is not None:
        outs = []
        for i, (first, length) in enumerate(gather.runs):
            k = k_cache.narrow(0, first, length).transpose(0, 1)[None]
            v = v_cache.narrow(0, first, length).transpose(0, 1)[None]
            outs.append(F.scaled_dot_product_attention(qg[i : i + 1], k, v, scale=sm_scale))
        out = outs[0] if n == 1 else torch.cat(outs)
        return out.reshape(n, hq, d)
    lmax = gather.lmax
    kbuf, vbuf = plan.gather_buffers(k_cache, gather.slots.numel())
    torch.index_select(k_cache.flatten(1), 0, gather.slots, out=kbuf)
    torch.index_select(v_cache.flatten(1), 0, gather.slots, out=vbuf)
    k = kbuf.view(n, lmax, hkv, d).transpose(1, 2)
    v = vbuf.view(n, lmax, hkv, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=gather.mask, scale=sm_scale)
    return out.reshape(n, hq, d)


def _prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: _Prefill, sm_scale: float
) -> torch.Tensor:
    """One request's query rows q [E, Hq, D] against its prefix + causal self -> [E, Hq, D]."""
    if p.run_start is not None:
        seq = p.prefix_len + q.shape[0]
        k = k_cache.narrow(0, p.run_start, seq)
        v = v_cache.narrow(0, p.run_start, seq)
    else:
        assert p.slots is not None
        k = k_cache.index_select(0, p.slots)
        v = v_cache.index_select(0, p.slots)
    out = F.scaled_dot_product_attention(
        q.to(k_cache.dtype).transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=p.mask,
        is_causal=p.mask is None,
        scale=sm_scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _every_token(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                 sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] with every token, a prompt's too, a row of the native
    kernel that attends to the first position + 1 slots of its request: the kernel splits a
    row by its length alone, so a token's result does not depend on its chunk or its step.
    Needs none of the SDPA plan's slots and masks."""
    every = meta.backend_cache.get(_EVERY_KEY)
    if every is None:
        ext = meta.extend_lens.to(torch.int64).cpu()
        rows = torch.repeat_interleave(meta.req_pool_indices.to(torch.int64).cpu(), ext)
        lens = torch.cat([torch.arange(p + 1, p + e + 1, dtype=torch.int64)
                          for p, e in zip(meta.prefix_lens_host, meta.extend_lens_host, strict=True)])
        every = native.DecodeAttention(meta.req_to_token, rows.contiguous(), lens)
        meta.backend_cache[_EVERY_KEY] = every
    return every(q, k_cache, v_cache, sm_scale)  # type: ignore[operator]


def native_decode(meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(req_to_token int32, rows int64 [B], lens int64 [B]) of a decode step whose attention
    this backend runs in place through the native kernel, for a caller that runs whole
    layers natively (`native.DecodeStep`); None where it does not (a prefill in the step,
    no native kernels, another req_to_token dtype or device)."""
    if not (meta.is_decode and native.available() and meta.req_to_token.dtype == torch.int32
            and meta.req_to_token.device.type == "cpu"):
        return None
    plan = _plan(meta)
    assert plan.decode_rows is not None
    return plan.req_to_token, plan.decode_rows, torch.tensor(plan.decode_lens, dtype=torch.int64)


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
    if native.rowwise(k_cache) and k.dtype == v.dtype == k_cache.dtype:
        native.store_rows(k, k_cache, meta.out_cache_loc)
        native.store_rows(v, v_cache, meta.out_cache_loc)
    else:
        k_cache.index_copy_(0, meta.out_cache_loc, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.out_cache_loc, v.to(v_cache.dtype))
    if (not meta.is_decode and meta.invariant and native.supports(q, k_cache)
            and meta.req_to_token.dtype == torch.int32):
        return _every_token(q, k_cache, v_cache, meta, sm_scale).to(q.dtype)
    plan = _plan(meta)
    if meta.is_decode:
        return _decode(q, k_cache, v_cache, plan, sm_scale).to(q.dtype)
    out = torch.empty_like(q)
    if plan.decode_tokens is not None:
        out[plan.decode_tokens] = _decode(
            q[plan.decode_tokens], k_cache, v_cache, plan, sm_scale
        ).to(q.dtype)
    for p in plan.prefills:
        out[p.q_start : p.q_end] = _prefill(q[p.q_start : p.q_end], k_cache, v_cache, p, sm_scale)
    return out
