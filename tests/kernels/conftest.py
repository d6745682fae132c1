"""Shared fixtures for the kernel tests: random KV pools and batches.

Without CUDA the Triton kernels run in the interpreter: TRITON_INTERPRET must be set
before a kernel module is decorated, so it is set here (at collection) and any kernel
module imported earlier without it is reloaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("store_kv", "decode", "extend", "triton_backend"):
        _module = sys.modules.get(f"kvserve.kernels.{_name}")
        if _module is not None:
            importlib.reload(_module)

from kvserve.kernels import StepMetadata, build_step_metadata  # noqa: E402
from kvserve.kernels.metadata import DecodeWorkspace  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Batch:
    """A random pool + batch: new q/k/v, caches with random prefix K/V, metadata."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    rows: list[int]
    prefix: list[int]
    extend: list[int]
    meta: StepMetadata


def make_batch(
    prefix: list[int],
    extend: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = DEVICE,
    block_q: int = 64,
    workspace: bool = True,
    contiguous: bool = False,
) -> Batch:
    """Scatter each request's sequence over random slots (slot 0 stays the dummy).

    With `contiguous`, each request gets one run of consecutive slots instead, as an
    allocator handing out whole runs would.
    """
    gen = torch.Generator().manual_seed(seed)
    bsz = len(prefix)
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    size = sum(seq) + 7
    max_ctx = max(seq) + 3
    req_to_token = torch.zeros(bsz + 3, max_ctx, dtype=torch.int32)
    rows = torch.randperm(bsz + 3, generator=gen)[:bsz].tolist()
    perm = (torch.randperm(size - 1, generator=gen) + 1).to(torch.int32)
    if contiguous:
        perm = torch.arange(1, size, dtype=torch.int32)
    off = 0
    for row, n in zip(rows, seq, strict=True):
        req_to_token[row, :n] = perm[off : off + n]
        off += n

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    t = sum(extend)
    ws = None
    if workspace:
        ws = DecodeWorkspace.create(max_batch=bsz, num_q_heads=num_q_heads, head_dim=head_dim,
                                    dtype=dtype, device=device, max_splits=8)
    req_to_token = req_to_token.to(device)
    meta = build_step_metadata(req_to_token=req_to_token, req_pool_indices=rows, prefix_lens=prefix,
                         extend_lens=extend, num_q_heads=num_q_heads, head_dim=head_dim,
                         device=device, workspace=ws, num_kv_heads=num_kv_heads, block_q=block_q)
    return Batch(
        q=rnd(t, num_q_heads, head_dim), k=rnd(t, num_kv_heads, head_dim),
        v=rnd(t, num_kv_heads, head_dim),
        k_cache=rnd(size, num_kv_heads, head_dim), v_cache=rnd(size, num_kv_heads, head_dim),
        req_to_token=req_to_token, rows=rows, prefix=prefix, extend=extend, meta=meta,
    )


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed against the reference: 1e-4 fp32, 2e-2 half precision."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def dense_oracle(b: Batch, sm_scale: float) -> torch.Tensor:
    """Float64 SDPA of each request on its own dense K/V (the cache after k/v are stored)."""
    outs = []
    off = 0
    for row, p, e in zip(b.rows, b.prefix, b.extend, strict=True):
        slots = b.req_to_token[row, : p + e].long()
        k_all = b.k_cache[slots].clone()
        v_all = b.v_cache[slots].clone()
        k_all[p:] = b.k[off : off + e]
        v_all[p:] = b.v[off : off + e]
        q = b.q[off : off + e].transpose(0, 1).double()
        mask = torch.arange(p + e, device=q.device)[None, :] <= (
            p + torch.arange(e, device=q.device)
        )[:, None]
        o = F.scaled_dot_product_attention(
            q, k_all.transpose(0, 1).double(), v_all.transpose(0, 1).double(),
            attn_mask=mask, scale=sm_scale, enable_gqa=True,
        )
        outs.append(o.transpose(0, 1))
        off += e
    return torch.cat(outs)


@contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """Import `bench/<name>.py` as a module for the duration of the block."""
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
