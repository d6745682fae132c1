"""Per-step attention metadata (`StepMetadata`) and the decode workspace.

`build_step_metadata` turns a batch description (rows of `req_to_token`, cached prefix lengths,
new-token counts) into the index tensors every attention backend reads: flat-token
offsets, query-tile maps for ragged prefill chunks, the slots the new tokens go to, their
positions, and the split-KV decode buffers.  It is built once per scheduler step and shared
by every layer.

This module knows nothing about requests, memsvc, scheduling or the model; it imports
only torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_BLOCK_Q = 64
MIN_TOKENS_PER_SPLIT = 256

IntsLike = torch.Tensor | Sequence[int]


@dataclass(slots=True)
class DecodeWorkspace:
    """Split-KV decode buffers, allocated once per runner and reused every step.

    `o_part[b, h, s]` holds split `s`'s normalised partial output, `ml_part[b, h, s]` its
    running max (log2 domain, scaled) and softmax denominator, `decode_out` the merged
    output.  Sized for `max_batch` decode requests and `max_splits` splits.
    """

    o_part: torch.Tensor  # [max_batch, Hq, max_splits, D] float32
    ml_part: torch.Tensor  # [max_batch, Hq, max_splits, 2] float32
    decode_out: torch.Tensor  # [max_batch, Hq, D] in the model dtype
    max_splits: int

    @classmethod
    def create(
        cls,
        *,
        max_batch: int,
        num_q_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_splits: int = 32,
    ) -> DecodeWorkspace:
        """Allocate the buffers for at most `max_batch` requests per decode step."""
        if min(max_batch, num_q_heads, head_dim, max_splits) < 1:
            raise ValueError(
                f"DecodeWorkspace sizes must be >= 1, got max_batch={max_batch}, "
                f"num_q_heads={num_q_heads}, head_dim={head_dim}, max_splits={max_splits}"
            )
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            o_part=torch.empty(max_batch, num_q_heads, max_splits, head_dim, **f32),
            ml_part=torch.empty(max_batch, num_q_heads, max_splits, 2, **f32),
            decode_out=torch.empty(max_batch, num_q_heads, head_dim, dtype=dtype, device=device),
            max_splits=max_splits,
        )


@dataclass(slots=True)
class DenseIndex:
    """Padded per-request views used by the torch backend (built lazily, once per step)."""

    slots: torch.Tensor  # [B, Lmax] int64 slot of each position, 0 past the end
    key_valid: torch.Tensor  # [B, Lmax] bool
    decode_rows: torch.Tensor  # int64 indices of requests with extend_len == 1
    prefill_rows: list[int]  # requests with extend_len > 1 (looped one by one)
    prefill_masks: list[torch.Tensor]  # per prefill request: [E, L] bool, True = visible
    decode_max_len: int  # longest sequence among the decode requests
    _head_major: dict[int, torch.Tensor] = field(default_factory=dict)

    def head_major_rows(self, num_kv_heads: int) -> torch.Tensor:
        """[Bd, Hkv, Ld] row indices into a cache viewed as [size * Hkv, D] (decode rows)."""
        rows = self._head_major.get(num_kv_heads)
        if rows is None:
            slots = self.slots[self.decode_rows, : self.decode_max_len]
            heads = torch.arange(num_kv_heads, device=slots.device)
            rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]
            self._head_major[num_kv_heads] = rows
        return rows


@dataclass(slots=True)
class StepMetadata:
    """Attention metadata of one step; every tensor lives on `device` unless noted.

    The seed called this `KVCache`; it holds no KV, only the indices a step's attention
    reads and writes the pool through."""

    req_to_token: torch.Tensor  # [max_reqs, max_context_len] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64 = prefix_lens + extend_lens
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    kv_indptr: torch.Tensor  # [B+1] int64 cumulative seq_lens
    qo_indptr: torch.Tensor  # [B+1] int64 cumulative extend_lens
    q_tile_to_batch: torch.Tensor  # [n_tiles] int32 request of each query tile
    q_tile_to_index: torch.Tensor  # [n_tiles] int32 tile number within its request
    out_cache_loc: torch.Tensor  # [T] int64 slots of the new tokens
    positions: torch.Tensor  # [T] int64 absolute positions of the new tokens
    is_decode: bool
    batch_size: int
    num_tokens: int
    max_seq_len: int
    max_extend_len: int
    block_q: int
    num_kv_splits: int
    seq_lens_host: list[int]
    prefix_lens_host: list[int]
    extend_lens_host: list[int]
    decode_o_part: torch.Tensor | None = None
    decode_ml_part: torch.Tensor | None = None
    decode_out: torch.Tensor | None = None
    invariant: bool = False
    """A token's attention computed as a function of its position and its KV alone, whatever
    else the step holds (issue 36): the CPU backend attends every token, prefill ones
    included, through the native per-row kernel whose split is fixed by the row's length."""
    _dense: DenseIndex | None = field(default=None, repr=False)
    backend_cache: dict[str, object] = field(default_factory=dict, repr=False)
    """Per-step state a backend builds on first use and reuses for every layer."""

    def dense(self) -> DenseIndex:
        """Padded gather indices and masks for the torch backend, computed on first use."""
        if self._dense is None:
            self._dense = _build_dense(self)
        return self._dense


def check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata) -> None:
    """The shape checks every backend's `attention` makes first; ValueError names the mismatch."""
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, meta has {meta.num_tokens}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")


def _host_ints(name: str, value: IntsLike) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.int64, device="cpu").reshape(-1)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
    return t


def choose_num_kv_splits(
    *, batch_size: int, num_heads: int, max_seq_len: int, max_splits: int, device: torch.device
) -> int:
    """Split count for flash-decoding: enough programs to fill the device, no tiny splits."""
    if device.type == "cuda":
        target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target_programs = 8
    by_len = -(-max_seq_len // MIN_TOKENS_PER_SPLIT)
    by_occupancy = -(-target_programs // max(batch_size * num_heads, 1))
    return max(1, min(max_splits, by_len, by_occupancy))


def _checked_lengths(req_to_token: torch.Tensor, req_pool_indices: IntsLike, prefix_lens: IntsLike,
                     extend_lens: IntsLike) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's rows, prefix and extend lengths as host int64 tensors, checked against
    each other and against `req_to_token`; ValueError names what is wrong."""
    rows = _host_ints("req_pool_indices", req_pool_indices)
    prefix = _host_ints("prefix_lens", prefix_lens)
    extend = _host_ints("extend_lens", extend_lens)
    b = rows.numel()
    if prefix.numel() != b or extend.numel() != b:
        raise ValueError(
            f"req_pool_indices, prefix_lens, extend_lens must have equal lengths, got "
            f"{b}, {prefix.numel()}, {extend.numel()}"
        )
    if b == 0:
        raise ValueError("build_step_metadata needs at least one request")
    if int(extend.min()) < 1:
        raise ValueError(f"every extend_len must be >= 1, got {extend.tolist()}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D, got shape {tuple(req_to_token.shape)}")
    seq = prefix + extend
    max_rows, max_ctx = req_to_token.shape
    if int(rows.max()) >= max_rows:
        raise ValueError(f"req_pool_indices out of range [0, {max_rows}): {rows.tolist()}")
    if int(seq.max()) > max_ctx:
        raise ValueError(f"seq_len {int(seq.max())} exceeds max_context_len {max_ctx}")
    return rows, prefix, extend


def build_step_metadata(
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: IntsLike,
    prefix_lens: IntsLike,
    extend_lens: IntsLike,
    num_q_heads: int,
    head_dim: int,
    device: torch.device | str,
    workspace: DecodeWorkspace | None = None,
    num_kv_heads: int | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    invariant: bool = False,
) -> StepMetadata:
    """Build the metadata of one batch (see docs/interfaces.md, "Attention backend").

    Raises ValueError naming the field when lengths disagree, a length is negative, a
    request has no new token, or a sequence does not fit in `req_to_token`.
    """
    device = torch.device(device)
    rows, prefix, extend = _checked_lengths(req_to_token, req_pool_indices, prefix_lens, extend_lens)
    b = rows.numel()
    seq = prefix + extend

    zero = torch.zeros(1, dtype=torch.int64)
    qo_indptr = torch.cat([zero, extend.cumsum(0)])
    kv_indptr = torch.cat([zero, seq.cumsum(0)])
    num_tokens = int(qo_indptr[-1])

    tiles_per_req = (extend + block_q - 1) // block_q
    tile_batch = torch.repeat_interleave(torch.arange(b), tiles_per_req)
    tile_start = torch.cat([zero, tiles_per_req.cumsum(0)])[:-1]
    tile_index = torch.arange(tile_batch.numel()) - tile_start[tile_batch]

    tok_batch = torch.repeat_interleave(torch.arange(b), extend)
    positions = torch.arange(num_tokens) - qo_indptr[tok_batch] + prefix[tok_batch]

    def dev(t: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return t.to(device=device, dtype=dtype, non_blocking=True)

    rows_d, positions_d = dev(rows), dev(positions)
    r2t = req_to_token if req_to_token.device == device else req_to_token.to(device)
    out_cache_loc = r2t[rows_d[dev(tok_batch)], positions_d].to(torch.int64)

    is_decode = bool(int(extend.max()) == 1)
    max_seq = int(seq.max())
    splits = 1
    if is_decode and workspace is not None:
        if b > workspace.o_part.shape[0]:
            raise ValueError(f"decode batch {b} exceeds workspace max_batch {workspace.o_part.shape[0]}")
        splits = choose_num_kv_splits(
            batch_size=b,
            num_heads=num_kv_heads or num_q_heads,
            max_seq_len=max_seq,
            max_splits=workspace.max_splits,
            device=device,
        )
    return StepMetadata(
        req_to_token=r2t,
        req_pool_indices=rows_d,
        seq_lens=dev(seq),
        prefix_lens=dev(prefix),
        extend_lens=dev(extend),
        kv_indptr=dev(kv_indptr),
        qo_indptr=dev(qo_indptr),
        q_tile_to_batch=dev(tile_batch, torch.int32),
        q_tile_to_index=dev(tile_index, torch.int32),
        out_cache_loc=out_cache_loc,
        positions=positions_d,
        is_decode=is_decode,
        batch_size=b,
        num_tokens=num_tokens,
        max_seq_len=max_seq,
        max_extend_len=int(extend.max()),
        block_q=block_q,
        num_kv_splits=splits,
        seq_lens_host=seq.tolist(),
        prefix_lens_host=prefix.tolist(),
        extend_lens_host=extend.tolist(),
        decode_o_part=workspace.o_part if workspace is not None else None,
        decode_ml_part=workspace.ml_part if workspace is not None else None,
        decode_out=workspace.decode_out if workspace is not None else None,
        invariant=invariant,
    )


def _build_dense(meta: StepMetadata) -> DenseIndex:
    device = meta.req_to_token.device
    lmax = meta.max_seq_len
    ar = torch.arange(lmax, device=device)
    key_valid = ar[None, :] < meta.seq_lens[:, None]
    cols = ar[None, :].expand(meta.batch_size, lmax)
    slots = meta.req_to_token[meta.req_pool_indices[:, None], cols].to(torch.int64)
    slots = torch.where(key_valid, slots, torch.zeros_like(slots))
    ext = meta.extend_lens_host
    decode_rows = [i for i, e in enumerate(ext) if e == 1]
    prefill_rows = [i for i, e in enumerate(ext) if e > 1]
    masks = []
    for i in prefill_rows:
        q_pos = meta.prefix_lens_host[i] + torch.arange(ext[i], device=device)
        k_pos = torch.arange(meta.seq_lens_host[i], device=device)
        masks.append(k_pos[None, :] <= q_pos[:, None])
    return DenseIndex(
        slots=slots,
        key_valid=key_valid,
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        prefill_rows=prefill_rows,
        prefill_masks=masks,
        decode_max_len=max((meta.seq_lens_host[i] for i in decode_rows), default=0),
    )
