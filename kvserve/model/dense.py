"""The float projection: y = x @ W.T (+ b) with a bfloat16 or float32 weight, on oneDNN's
prepacked bf16 GEMM where the CPU has native bfloat16 (`pack`), otherwise `F.linear`. The
weight-only kinds (`quant`) keep one of these as their dense copy for large batches.

A request's numbers must not depend on how many rows its step has (issue 36): the packed GEMM
gives a row the same bits in any call of two rows or more, and a lone row is run as two where
the weight's shape needs it (`lone_row_differs`). Knows torch; nothing about files or
scheduling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] reordered into oneDNN's blocked layout for `packed_linear`, or None where
    that does not pay or is not there: a bfloat16 weight on a CPU with native bfloat16 (AVX-512
    BF16 or AMX). A prepacked weight skips the reorder oneDNN does on every call: 1.3-2.6x
    faster GEMMs for the default model's projections from 1 to 128 rows (2026-12-05, Intel
    Xeon with AMX), the same numbers (the reorder is all that changes). It is checked once
    against `F.linear` on a probe batch; a mismatch keeps the plain path."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.linspace(-1, 1, 4 * weight.shape[1], dtype=weight.dtype).reshape(4, -1)
        if not torch.allclose(packed_linear(probe, packed, None), F.linear(probe, weight), rtol=1e-2, atol=1e-2):
            return None
    except RuntimeError:
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T (+ b) with a weight from `pack`. oneDNN gives a row the same bits in any
    call of 2 rows or more (any position, up to 2,048 rows: AMD Zen 4, AVX-512 BF16), but one
    row alone runs another kernel whose result differs in the last place for about one row in
    ten at some shapes (the default model's down projection, K 1,536; not its K-576 ones):
    `Linear` runs a lone row as two where `lone_row_differs`, so that a request's numbers do
    not depend on how many rows its step has (tests/model/test_quant.py; issue 36)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


LONE_ROW_PROBES = 64


def lone_row_differs(packed: torch.Tensor) -> bool:
    """Whether a row alone gets other bits from `packed_linear` than in a call of several
    rows, on `LONE_ROW_PROBES` seeded random rows: the weight's shape on this CPU's kernels
    decides it. A lone row as two is paid only where it changes numbers: on the default model
    in bf16 without quantization (AMD Zen 4) the down projections only, a one-row decode step
    20.7 -> 22.5 ms (13-15 % with every projection and the head paired), 8 rows unchanged."""
    k = packed.shape[1] if packed.dim() == 2 else None
    if k is None:
        return True
    x = torch.randn(LONE_ROW_PROBES, k, generator=torch.Generator().manual_seed(0)).to(packed.dtype)
    many = packed_linear(x, packed, None)
    return any(not torch.equal(packed_linear(x[r : r + 1], packed, None)[0], many[r]) for r in range(x.shape[0]))


class Linear:
    """y = x @ W.T (+ b) with a float weight, or with its `packed` form (from `pack`; then
    `weight` may be dropped: activations of any shape and float dtype are served).
    `lone_rows` False: the caller never hands it a lone row (a weight-only kernel's dense
    copy, which takes only batches above its rows), so `lone_row_differs` is not probed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None = None,
                 *, lone_rows: bool = True) -> None:
        self.weight, self.bias, self.packed = weight, bias, packed
        self.lone_as_pair = lone_rows and packed is not None and lone_row_differs(packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and x.dtype == self.packed.dtype:
            if x.shape[0] == 1 and self.lone_as_pair:  # see lone_row_differs
                return packed_linear(x.expand(2, -1), self.packed, self.bias)[:1]
            return packed_linear(x, self.packed, self.bias)
        shape = x.shape
        y = packed_linear(x.reshape(-1, shape[-1]).to(self.packed.dtype), self.packed, self.bias)
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
