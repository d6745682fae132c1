"""The native weight-only projections: `int4_mm` (csrc/int4_mm.c, 4-bit weights in
`kvserve.model.quant.int4_blocks`' layout) and `int8_mm` (csrc/int8_mm.c, 8-bit weights in
groups of 32), both on 8-bit activations, each with a weight class that checks its weight
once. Knows nothing of the model's linear layers that choose them.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels.native import loader
from kvserve.kernels.native.abi import _SUFFIX, _traced


def int4_available() -> bool:
    """Whether `int4_mm` runs here (the build targets AVX-512 BW, VL and VNNI, or AVX2)."""
    lib = loader._load()
    return lib is not None and bool(lib.kvs_int4_available())


def int4_mm(x: torch.Tensor, nib: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
            lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, rows contiguous) @ W.T -> [M, N] in x's dtype, for the 4-bit
    weight W in `kvserve.model.quant.int4_blocks`' layout: `nib` uint8 [N, K/2], the groups'
    scales `d` and minima `m` float16 [N, K/32]. The activations are quantized to 8 bits per
    group of 32 (csrc/int4_mm.c); each row's result depends on that row alone. `lib`: another
    build (tests). One weight multiplied many times: `Int4Weight`, which checks it once."""
    return Int4Weight(nib, d, m, lib)(x)


class _NativeWeight:
    """A weight checked once for one of the weight-only kernels (`int4_mm`, `int8_mm`: the same
    C signature after the weight's own pointers); calling it with x [M, K] multiplies."""

    __slots__ = ("n", "k", "_fn", "_weight", "_keep")
    _name = ""  # the kernel's, for the errors and the profiler

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dim() == 2 and x.shape[1] == self.k and x.dtype in _SUFFIX and x.stride(1) == 1
                and x.device.type == "cpu"):
            raise ValueError(f"{self._name}: x [M, {self.k}] bf16 or fp32 with contiguous rows, got x "
                             f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
        y = x.new_empty(x.shape[0], self.n)
        bf16 = x.dtype == torch.bfloat16
        with _traced(f"kvserve::{self._name}"):
            rc = self._fn(x.data_ptr(), bf16, x.stride(0), x.shape[0], self.k, *self._weight, y.data_ptr(), bf16)
        if rc:
            raise MemoryError(f"{self._name}: no scratch for {x.shape[0]} rows of {self.k}")
        return y


class Int4Weight(_NativeWeight):
    """A 4-bit weight checked once for `int4_mm`; calling it with x [M, K] multiplies (a
    decode step makes one call per projection and layer: 4 per layer, each a few
    microseconds of kernel, so the per-call Python is kept to a few checks of x)."""

    __slots__ = ()
    _name = "int4_mm"

    def __init__(self, nib: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 lib: ctypes.CDLL | None = None) -> None:
        lib = lib or loader._load()
        assert lib is not None, "int4_mm called where available() is False"
        n, half = nib.shape if nib.dim() == 2 else (0, -1)
        k = 2 * half
        if not (nib.device.type == "cpu" and nib.dtype == torch.uint8 and nib.is_contiguous()
                and k > 0 and k % 64 == 0 and d.dtype == m.dtype == torch.float16
                and d.shape == m.shape == (n, k // 32) and d.is_contiguous() and m.is_contiguous()):
            raise ValueError(f"int4_mm: nib uint8 [N, K/2] with K a multiple of 64, d and m float16 "
                             f"[N, K/32]; got nib {tuple(nib.shape)} {nib.dtype}, d {tuple(d.shape)} "
                             f"{d.dtype}, m {tuple(m.shape)} {m.dtype}")
        if not lib.kvs_int4_available():
            raise ValueError("int4_mm: this build has no 4-bit kernel (int4_available() is False)")
        self.n, self.k = n, k
        self._fn = lib.kvs_int4_mm
        self._weight = (nib.data_ptr(), d.data_ptr(), m.data_ptr(), n)
        self._keep = (nib, d, m)  # the pointers' owners


def int8_available() -> bool:
    """Whether `int8_mm` runs here (the build targets AVX-512 BW, VL and VNNI, or AVX2)."""
    lib = loader._load()
    return lib is not None and bool(lib.kvs_int8_available())


def int8_mm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, rows contiguous) @ W.T -> [M, N] in x's dtype, for the weight
    W = d * q in groups of 32 inputs per output row (GGUF Q8_0's shape): `q` int8 [N, K], the
    groups' scales `d` float16 [N, K/32], both row-major (`kvserve.model.quant.int8_groups`).
    The activations are quantized to 8 bits per group of 32 (csrc/int8_mm.c); each row's
    result depends on that row alone. `lib`: another build (tests). One weight multiplied
    many times: `Int8Weight`, which checks it once."""
    return Int8Weight(q, d, lib)(x)


class Int8Weight(_NativeWeight):
    """An 8-bit weight in groups of 32 checked once for `int8_mm`; calling it with x [M, K]
    multiplies (the output head: one call per decode step)."""

    __slots__ = ()
    _name = "int8_mm"

    def __init__(self, q: torch.Tensor, d: torch.Tensor, lib: ctypes.CDLL | None = None) -> None:
        lib = lib or loader._load()
        assert lib is not None, "int8_mm called where available() is False"
        n, k = q.shape if q.dim() == 2 else (0, -1)
        if not (q.device.type == "cpu" and q.dtype == torch.int8 and q.is_contiguous() and k > 0
                and k % 32 == 0 and d.dtype == torch.float16 and d.shape == (n, k // 32)
                and d.is_contiguous() and d.device.type == "cpu"):
            raise ValueError(f"int8_mm: q int8 [N, K] with K a multiple of 32, d float16 [N, K/32]; "
                             f"got q {tuple(q.shape)} {q.dtype}, d {tuple(d.shape)} {d.dtype}")
        if not lib.kvs_int8_available():
            raise ValueError("int8_mm: this build has no 8-bit kernel (int8_available() is False)")
        self.n, self.k = n, k
        self._fn = lib.kvs_int8_mm
        self._weight = (q.data_ptr(), d.data_ptr(), n)
        self._keep = (q, d)  # the pointers' owners
