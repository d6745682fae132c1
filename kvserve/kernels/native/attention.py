"""The native decode attention (csrc/decode_attention.c): `supports` says which queries and
caches it takes, `DecodeAttention` binds one step's requests once and is called per layer,
`decode_attention` is the one-off call. Knows nothing of the backend's plans or the model.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels.native import loader
from kvserve.kernels.native.abi import _KERNELS, _traced


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these (CPU, bf16 or fp32, head counts and D in bounds)."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in _KERNELS or not loader.available():
        return False
    max_group, max_d = loader.limits()
    hq, hkv, d = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    return hq % hkv == 0 and hq // hkv <= max_group and d <= max_d


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                     sm_scale: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] (cache dtype): row b attends to the K/V at slots
    req_to_token[rows[b], :lens[b]] of k_cache/v_cache [size, Hkv, D]. `rows` and `lens` are
    int64 [B]; ValueError names a slot outside the pool. `lib`: another build (tests). A
    step's layers share `rows` and `lens`: `DecodeAttention` checks those once."""
    return DecodeAttention(req_to_token, rows, lens, lib)(q, k_cache, v_cache, sm_scale)


_LAYOUT = "decode_attention: contiguous caches, int32 req_to_token, int64 rows/lens"


class DecodeAttention:
    """`decode_attention` bound to one step's requests (req_to_token, rows, lens: checked
    here once), called per layer with (q, k_cache, v_cache, sm_scale)."""

    __slots__ = ("_lib", "_r2t", "_rows", "_lens", "_args")

    def __init__(self, req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                 lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib or loader._load()
        assert self._lib is not None, "decode_attention called where available() is False"
        if not (req_to_token.is_contiguous() and req_to_token.dtype == torch.int32 and req_to_token.dim() == 2
                and rows.dtype == torch.int64 and lens.dtype == torch.int64 and rows.dim() == 1
                and rows.shape == lens.shape and rows.is_contiguous() and lens.is_contiguous()):
            raise ValueError(_LAYOUT)
        self._r2t, self._rows, self._lens = req_to_token, rows, lens
        self._args = (req_to_token.data_ptr(), req_to_token.shape[0], req_to_token.shape[1],
                      rows.data_ptr(), lens.data_ptr(), rows.shape[0])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sm_scale: float) -> torch.Tensor:
        dtype = k_cache.dtype
        if q.dtype != dtype or not q.is_contiguous():
            q = q.to(dtype).contiguous()
        b, hq, d = q.shape
        size, hkv, _ = k_cache.shape
        if not (b == self._args[-1] and dtype in _KERNELS and k_cache.is_contiguous() and v_cache.is_contiguous()
                and v_cache.shape == k_cache.shape and v_cache.dtype == dtype):
            raise ValueError(f"{_LAYOUT}, q [{self._args[-1]}, Hq, D]")
        out = torch.empty_like(q)
        with _traced("kvserve::decode_attention"):
            bad = getattr(self._lib, _KERNELS[dtype])(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), *self._args,
                hq, hkv, d, size, sm_scale)
        if bad < 0:
            row = -bad - 1
            raise ValueError(f"decode_attention: batch row {row} names row {int(self._rows[row])} or length "
                             f"{int(self._lens[row])} outside req_to_token {tuple(self._r2t.shape)}")
        if bad:
            raise ValueError(f"decode_attention: batch row {bad - 1} has a slot outside the pool of {size}")
        return out
