"""What the tests of the native weight-only kernels (int4_mm, int8_mm) share: their two
builds, and the activations as the kernels quantize them."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def check_exact_sums(mm: Callable[[torch.Tensor], torch.Tensor], grid: torch.Tensor, dtype: torch.dtype) -> None:
    """mm(x [M, K]) -> [M, N], a kernel for the weight `grid` [N, K] (float64), computes exactly
    the sums of x's quantized activations and the weight, a row of zeros gives zeros, each row
    alone as in any batch (the 8-row passes included), and strided rows the same values."""
    n, k = grid.shape
    x = (torch.randn(11, k, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
    x[3] = 0  # a row of zeros: scale 0, no division by it
    x[4, :GROUP] = 0  # and a group of zeros
    y = mm(x)
    assert y.dtype == dtype and y.shape == (11, n)
    want = quantized_activations(x).double() @ grid.t()
    assert torch.equal(y[3], torch.zeros(n, dtype=dtype))
    if dtype == torch.float32:  # float32 sums of exact integer dots
        assert (y.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    else:  # the float32 result rounded to bf16 once
        assert torch.allclose(y.double(), want, rtol=2**-8, atol=1e-6 * want.abs().max().item())
    for r in (0, 7, 8, 10):
        assert torch.equal(mm(x[r : r + 1])[0], y[r])
    assert torch.equal(mm(x[5:9]), y[5:9])
    wide = torch.cat([x, torch.ones(11, 64, dtype=dtype)], 1)[:, :k]
    assert torch.equal(mm(wide), y)


def check_within_rounding(mm: Callable[[torch.Tensor], torch.Tensor], grid: torch.Tensor) -> None:
    """mm(x) differs from the float product x @ grid.T by no more than the activations'
    rounding (each moves by at most half a step of its group, amax / 254), and does differ."""
    n, k = grid.shape
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(8))
    y = mm(x).double()
    exact = x.double() @ grid.t()
    amax = x.double().reshape(6, k // GROUP, GROUP).abs().amax(-1)
    bound = (amax[:, :, None] / 254 * grid.abs().reshape(n, k // GROUP, GROUP).permute(1, 2, 0)
             .sum(1)[None]).sum(1)  # [rows, N]
    err = (y - exact).abs()
    assert (err <= bound * 1.001 + 1e-6).all(), (err / bound).max()
    assert err.max() > 0  # the activations are quantized


def tiny_model(tmp_path: Path, dtype: torch.dtype, quantization: str) -> Any:
    """The tiny random model (hidden 64, MLP 128: K multiples of 64) loaded in `quantization`."""
    from kvserve.model.weights import load_model
    from tests.model.tinymodel import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    return load_model(str(path), dtype=dtype, quantization=quantization).model


def six_token_logits(model: Any) -> torch.Tensor:
    """The logits of every position of 6 tokens (under every dense copy's rows, so the
    kernels run), attention by plain causal SDPA."""
    ids = torch.arange(3, 9)

    def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)

    return model.forward_tokens(ids, torch.arange(len(ids)), attend, torch.arange(len(ids)))


def check_close_logits(fast: torch.Tensor, plain: torch.Tensor, rel: float) -> None:
    """`fast` (another kernel's logits) differs from `plain`, within `rel` of its norm, and
    where plain's top logit leads by more than twice the largest change the top token stays."""
    assert not torch.equal(fast, plain)
    assert ((fast - plain).norm() / plain.norm()).item() < rel
    top2 = plain.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (fast - plain).abs().max()
    assert clear.any() and torch.equal(fast.argmax(-1)[clear], plain.argmax(-1)[clear])
