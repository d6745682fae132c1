"""What the tests of the native weight-only kernels (int4_mm, int8_mm) share: their two
builds, and the activations as the kernels quantize them."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvserve.kernels import native
from kvserve.model.quant import GROUP


def kernel_build(which: str, available: str) -> ctypes.CDLL:
    """This CPU's build ("native": AVX-512 VNNI where it has it) or the AVX2 one ("avx2", as on
    a CPU without AVX-512), skipped where the build's `available` function (kvs_int4_available,
    kvs_int8_available) says it has no such kernel; the AVX2 build must have the AVX2 one."""
    built = native.build() if which == "native" else native.build(("-mno-avx512f",))
    assert built is not None, "the kernels did not build with the system compiler"
    kind = getattr(built, available)()
    if not kind:
        pytest.skip(f"{available}() is 0 in the {which} build on this CPU: torch's kernel runs")
    if which == "avx2":
        assert kind == 2
    return built


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize it: per group of 32, q = x * (127 / amax) rounded to nearest
    even (float32), times amax / 127."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    # an IEEE float32 division, as the kernel's (torch's scalar / tensor multiplies by a
    # reciprocal: a last-place difference that moves a product off a tie)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127.0)).reshape(m, k)
