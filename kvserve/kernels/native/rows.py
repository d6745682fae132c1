"""The native row ops (csrc/elementwise.c): the model's RMS norm and rotary embedding, the
KV store at a step's slots, and greedy sampling's one-pass argmax over a step's logits,
each with torch's numbers. Knows nothing of the model, the pool's owner or the sampler.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.kernels.native import loader
from kvserve.kernels.native.abi import _SUFFIX


def rowwise(x: torch.Tensor) -> bool:
    """Whether `rms_norm` and `rotary` take `x` (a contiguous bf16 or fp32 CPU tensor)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and x.is_contiguous() and loader.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, normalised in float32 and rounded to x's
    dtype before the weight, as transformers' LlamaRMSNorm (`rowwise(x)` must hold)."""
    dim = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (dim,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous [{dim}] {x.dtype}")
    out = torch.empty_like(x)
    rows = x.numel() // dim if dim else 0
    _row_fns(loader._load())[x.dtype][0](x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, dim, eps)
    return out


@functools.cache
def _row_fns(lib: ctypes.CDLL | None) -> dict[torch.dtype, tuple]:
    """{dtype: (rms_norm, rotary)} of a build."""
    assert lib is not None
    return {dtype: (getattr(lib, "kvs_rms_norm_" + sfx), getattr(lib, "kvs_rotary_" + sfx))
            for dtype, sfx in _SUFFIX.items()}


def rotary(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """The first `heads` heads of each row of x [T, >= heads * D] (rows may be strided, the
    values of a row contiguous) rotated in the rotate-half layout by their positions
    (int64 [T]) with float32 cos/sin tables [P, D/2], rounding as torch's ops in x's dtype
    do -> [T, heads, D]. ValueError names a position outside the tables."""
    lib = loader._load()
    assert lib is not None
    tokens = x.shape[0]
    half = cos.shape[1]
    d = 2 * half
    if not (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] >= heads * d and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.shape == (tokens,)):
        raise ValueError("rotary: x [T, >= heads*D] with contiguous rows, float32 tables [P, D/2], "
                         "int64 positions [T]")
    out = x.new_empty(tokens, heads, d)
    bad = _row_fns(lib)[x.dtype][1](
        x.data_ptr(), x.stride(0), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        positions.data_ptr(), tokens, heads, d)
    if bad:
        raise ValueError(f"rotary: position {int(positions[bad - 1])} of token {bad - 1} is outside "
                         f"the tables of {cos.shape[0]}")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * inter] (gate first; rows contiguous), rounding as
    the one-call layer does (csrc/decode_layer.c: its SiLU's exp, not torch's), so that a
    row's activation is the same in a step of any size (`rowwise(gate_up)` must hold)."""
    rows, width = gate_up.shape
    if width % 2 or not rowwise(gate_up):
        raise ValueError("silu_mul: gate_up must be a contiguous [T, 2 * inter] bf16 or fp32 CPU tensor")
    out = gate_up.new_empty(rows, width // 2)
    getattr(loader._load(), "kvs_silu_mul_" + _SUFFIX[gate_up.dtype])(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For each row of x [B, V] (float32 or bfloat16 on the CPU, each row contiguous): the
    index of its first largest value (int64 [B], torch's argmax) and whether all its values
    are finite (bool [B]; a row that is not gets index 0), in one pass over the row: greedy
    sampling's read of a step's logits. None where the native kernels are not there or x is
    not such a tensor."""
    if not (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] > 0 and loader.available()):
        return None
    rows = x.shape[0]
    index = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.bool)
    getattr(loader._load(), "kvs_row_argmax_" + _SUFFIX[x.dtype])(
        x.data_ptr(), rows, x.shape[1], x.stride(0), index.data_ptr(), finite.data_ptr())
    return index, finite


def store_rows(src: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor) -> None:
    """cache[loc[t]] = src[t] for src [T, *row] (each token's row contiguous, tokens may be
    strided) into cache [size, *row] of the same dtype (contiguous), loc int64 [T]: a
    step's new K or V at their slots. ValueError names a slot outside the cache (then
    nothing is written)."""
    lib = loader._load()
    assert lib is not None
    tokens = src.shape[0]
    row = cache[0].numel() if cache.shape[0] else 0
    if not (src.dim() >= 2 and src.dtype == cache.dtype and cache.is_contiguous()
            and src.shape[1:] == cache.shape[1:]
            and (tokens == 0 or src.stride()[1:] == cache.stride()[1:] or src[0].is_contiguous())
            and loc.dtype == torch.int64 and loc.is_contiguous() and loc.shape == (tokens,)
            and src.device == cache.device):
        raise ValueError("store_rows: src [T, *row] with contiguous rows, cache [size, *row] "
                         "contiguous of the same dtype, int64 loc [T]")
    size = src.element_size()
    bad = lib.kvs_store_rows(src.data_ptr(), src.stride(0) * size, cache.data_ptr(), cache.shape[0],
                             loc.data_ptr(), tokens, row * size)
    if bad:
        raise ValueError(f"store_rows: slot {int(loc[bad - 1])} of token {bad - 1} is outside the "
                         f"cache of {cache.shape[0]}")
