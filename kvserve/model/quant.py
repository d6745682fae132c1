"""Weight-only quantization of the projections on CPU, onto torch's weight-only kernels.

`int8`: one scale per output row (symmetric, 127 steps), `torch._weight_int8pack_mm`.
`int4`: groups of 32 inputs per output row with a scale and a minimum each (asymmetric, 16
steps), `torch._weight_int4pack_mm_for_cpu`. That is the shape of GGUF's Q4_1 blocks
(`w = d·q + m` over 32 values, with the block's minimum at q = 0 and maximum at q = 15), so a
Q4_1 file's dequantized weights quantize back onto exactly their own 4-bit codes; the
kernel holds each group's scale and zero point in bfloat16 (the file has float16 d and m).
The output head is int8 in both modes (what llama.cpp's files keep at 8 bits or more). The
embedding table stays in the model dtype.

Both kernels take their activations in bfloat16 (whatever the model dtype; the output is
cast back): with float32 activations torch 2.13 takes a fallback 7-50× slower than a float32
matmul on an AVX-512 CPU, with bfloat16 ones it beats it (bench/quant_fidelity.py).

Where the runner's native kernels have a 4-bit one (AVX-512 VNNI or AVX2: `LlamaForCausalLM.use_row_ops`
hands it to `Int4Linear.use_ops`), int4 projections multiply through it instead: the same
codes with the file's float16 scale and minimum (`int4_blocks` lays them out), on
activations quantized to int8 per group of 32 as llama.cpp's Q4_1 dots do, integer dot
products instead of torch's per-weight float conversion. The dense copies stay the grid of
torch's kernel (bfloat16 scale and zero point). The int8 projections and the output head
likewise where they have an 8-bit one (`Int8Linear.use_ops`): each also keeps its weight in
groups of 32 with a float16 scale each (`int8_groups`: GGUF Q8_0's blocks, so a Q8_0 file's
own codes, finer than torch's one scale per row), and once the native kernel multiplies by
those its dense copy holds their values.

`auto` (the default) follows the file: on CPU, a GGUF whose projections are mostly 4-bit
(Q4_0, Q4_1, Q4_K, IQ4) runs int4, mostly 5 to 8-bit (Q5_*, Q6_K, Q8_0) int8, and float
weights (F32, F16, BF16, a Hugging Face directory) or a CUDA device run none: a quantized
file is served at its own precision, as llama.cpp serves it, and is 3-4x faster at one
stream than its dequantized weights here (bench/quant_fidelity.py measures that and its
greedy agreement with the float reference; README.md has the figures).

`Linear` is what a layer calls for `x @ W.T + b`; `quantize` gives the one for a weight in a
mode (`LlamaForCausalLM.quantize` swaps a loaded model's projections, each with a dense copy
of its quantized values for batches of more than `DENSE_ROWS` rows, and frees the float
weights). Knows torch; nothing about files, slots or scheduling.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvserve.model.dense import Linear, pack

MODES = ("none", "int8", "int4")
DENSE_ROWS = 8
"""Batches of more rows than this (prefill chunks, many streams) multiply by a dense copy of
the quantized weight in the model dtype. Measured 2026-12-04 (2-core AMD EPYC, avx512_bf16;
the default model's gate_up projection, bf16): int4 kernel / dense GEMM 55/148 us at 1 row,
173/229 at 8, 395/347 at 16, 3151/1311 at 128: the kernel's time grows with every row.
With the dense copy packed for oneDNN (`pack`) a warm GEMM wins from 4 rows, but in a real
step the weights come cold from memory and the dense copy is 4x the bytes of int4: whole
decode steps of the default model (bench/step_profile.py --packed-rows, 2026-12-05, Intel
Xeon with AMX, ms) at 4 / 8 / 16 rows: dense above 3 rows 43-51 / 47-54 / 59-65, above 8
27-31 / 42-53 / 60-69, above 16 27-32 / 41-46 / 75-82. So 8 stays."""
NATIVE_INT4_DENSE_ROWS = 16
"""The same switch for int4 projections on the native kernel, whose time grows more slowly
with rows: whole decode steps of the default model, int4 native vs the dense copy from 8
rows (bench/step_profile.py --packed-rows 32 vs 8, two runs each, 2026-12-05, Intel Xeon
with AMX, ms) at 12 / 16 / 24 / 32 rows: 21.6-27.6 vs 28.2, 24.5-25.7 vs 29.9-30.2,
34.5-36.7 vs 34.9, 42.6-42.9 vs 38.1-39.5."""
NATIVE_INT4_FLOAT_DENSE_ROWS: int | None = None
"""The same switch where the dense copy would be a plain float GEMM (not packed by `pack`: no
native bf16, so float32): None, no dense copy at all, the native kernel takes every batch and
the float32 copy (4x the int4 bytes: 424 MB for the default model) is freed. The default
model's four projections, native int4 (AVX2 build, activation rows in passes of 6 through
blocks of 32 outputs) vs float32 dense (`bench/int4_kernel.py --dense`, 2026-12-06, AMD EPYC
Zen 2, AVX2 only, 2 cores, median ms): 30 layers at 1 / 8 / 32 / 128 / 256 rows 5.6 vs 33.9,
15.5 vs 61.6, 48.1 vs 100.0, 191.4 vs 237.8, 401.2 vs 430.6 (before the passes: 257 at 128
rows); 6 layers at 512 / 1024 / 2048 rows 138.9 vs 154.2, 281.0 vs 300.2, 566.8 vs 592.3."""
NATIVE_INT8_DENSE_ROWS = DENSE_ROWS
"""The switch for int8 projections on the native 8-bit kernel (`Int8Linear.use_ops`) where
the dense copy is packed for oneDNN: torch's int8 kernel's value, not measured for the native
one (no CPU with native bf16 at hand when it came)."""
NATIVE_INT8_FLOAT_DENSE_ROWS = 128
"""The same where the dense copy is a plain float GEMM (no native bf16: float32): the default
model's four projections of 30 layers, native int8 vs torch's int8 kernel vs float32 dense,
weights from memory (`bench/int8_head.py --projections --dense`, median of 5, 2026-12-06,
AMD EPYC Zen 2, AVX2 only, 2 cores, ms) at 1 / 8 / 16 / 32 / 64 / 128 rows: 6.7 / 12.7 /
37.3, 17.3 / 27.5 / 56.4, 33.0 / 47.8 / 71.2, 63.3 / 88.7 / 96.7, 130.5 / 177.2 / 155.2,
262.1 / 346.3 / 267.6 (even at 128)."""
HEAD_DENSE_ROWS = 4
"""An int8 output head whose dense copy is packed for oneDNN (native bf16) takes it above this
many rows, the projections above `quant.DENSE_ROWS`: torch's int8 kernel grows faster with
rows on the head's 49,152 outputs. Whole decode steps of the default model, int8 head vs
packed bf16 above 1 row (median of 6 alternating rounds, 2026-12-05, Intel Xeon with AMX):
0.98x at 2 and 4 rows, 1.08x at 8. The native 8-bit head (`LlamaForCausalLM.use_row_ops`) keeps it too: not
measured for that kernel (no AMX machine at hand when it came)."""
HEAD_FLOAT_DENSE_ROWS = 64
"""The same switch where the head's dense copy is a plain float32 GEMM (no native bf16):
torch's int8 kernel vs float32 dense on the head's [49,152, 576] (warm, 2026-12-06, AMD EPYC
Zen 2, AVX2 only, 2 cores, ms) at 8 / 16 / 32 / 64 / 128 rows: 7.6 vs 26.8, 14.9 vs 30.1,
30.2 vs 40.0, 59.2 vs 59.6, 116.7 vs 94.1."""
NATIVE_HEAD_FLOAT_DENSE_ROWS = 256
"""`HEAD_FLOAT_DENSE_ROWS` for the native 8-bit head (`LlamaForCausalLM.use_row_ops`), whose time grows more
slowly with rows than torch's int8 kernel: native vs float32 dense on the head's [49,152,
576] (bench/int8_head.py --dense, median of 5 cold passes, 2026-12-06, AMD EPYC Zen 2, AVX2
only, 2 cores, ms) at 8 / 16 / 32 / 64 / 128 / 256 rows: 4.1 vs 25.1, 8.3 vs 30.1, 16.3 vs
40.3, 31.9 vs 57.7, 63.1 vs 91.0, 140.5 vs 159.7; even at 384 (213.4 vs 214.4), dense ahead
at 512 (282.4 vs 268.3)."""


GROUP = 32
_INNER_K_TILES = 2  # the CPU packing's K tiling (K must be a multiple of 16 × this)
ACT = torch.bfloat16  # the kernels' activation dtype
_NATIVE_ACTS = (torch.bfloat16, torch.float32)  # what the native kernels take as is


class _WeightOnly:
    """A weight-only kernel's y = x @ W.T (+ b): `x` in any float dtype and batch shape, `y`
    in `x`'s dtype; torch's kernels compute on bfloat16 activations, a native one (`kernel`,
    from `use_ops`) takes float32 or bfloat16 as they are. With a `dense` copy of the
    quantized weight (the values the kernel computes with, in the model dtype), batches of
    more than `dense_rows` rows (`DENSE_ROWS` unless a native kernel or the model set
    another) take the float GEMM instead."""

    bias: torch.Tensor | None
    dense: Linear | None = None
    kernel: Any = None  # a native kernel's weight once `use_ops` chose it (bf16 or fp32 x [M, K] -> [M, N])
    dense_rows = DENSE_ROWS  # an attribute: bench/step_profile.py --packed-rows moves it

    @property
    def kernel_rows(self) -> float:
        """The most rows a batch has for the kernel to take it: `dense_rows` with a dense copy,
        any number without one."""
        return self.dense_rows if self.dense is not None else math.inf

    @property
    def dense_packed(self) -> bool:
        """Whether the dense copy is packed for oneDNN (`pack`: native bf16), not a plain float
        GEMM: the two cross the kernels at different rows."""
        return self.dense is not None and self.dense.packed is not None

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on 2-D bfloat16 activations."""
        raise NotImplementedError

    def set_dense(self, grid: torch.Tensor) -> None:
        """Keep `grid` (the quantized values in the model dtype) for large batches, packed for
        oneDNN where `pack` can."""
        packed = pack(grid)
        self.dense = Linear(grid if packed is None else torch.empty(0, dtype=grid.dtype), self.bias, packed,
                            lone_rows=False)  # it takes batches above `dense_rows` only

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.dense is not None and x.numel() > self.dense_rows * shape[-1]:
            return self.dense(x)
        if self.kernel is not None and x.dim() == 2 and x.stride(1) == 1 and x.dtype in _NATIVE_ACTS:
            y = self.kernel(x)  # float32 or bfloat16 as they are
        else:
            flat = x.reshape(-1, shape[-1])
            y = self._mm(flat.contiguous() if self.kernel is not None else flat.to(ACT)).to(x.dtype)
            y = y.reshape(*shape[:-1], y.shape[-1])  # not -1: a step may ask no logits (0 rows)
        return y if self.bias is None else y + self.bias


class Int8Linear(_WeightOnly):
    """Per-row symmetric int8 weight [N, K] with float scales [N] for torch's kernel; with
    `groups` (where K is a multiple of 32), also in groups of 32 (`int8_groups`: Q8_0's
    shape) for a native kernel (`use_ops`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, groups: bool = False) -> None:
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(ACT)
        self.bias = bias
        self.groups = int8_groups(weight) if groups and weight.shape[1] % GROUP == 0 else None

    def dequantized(self) -> torch.Tensor:
        """The float weight the kernel in use multiplies by: torch's per-row grid, or the
        groups' once `use_ops` chose the native kernel."""
        if self.kernel is not None:
            return int8_dequantized(*self.groups)
        return self.qweight.float() * self.scales.float()[:, None]

    def use_ops(self, ops: Any) -> None:
        """Multiply through `ops.Int8Weight(q, d)` (a callable: bf16 or fp32 x [M, K] -> [M, N])
        where `ops.int8_available()` holds: free torch's per-row copy and make the dense copy
        the groups' values (what the kernel computes with). Otherwise drop the groups and keep
        torch's kernel. Once chosen, the choice stays (either copy is freed). `dense_rows`
        becomes the native kernel's (the projections'; the head sets its own)."""
        if self.kernel is not None or self.groups is None:
            return
        if ops is not None and ops.int8_available():
            self.kernel = ops.Int8Weight(*self.groups)
            self.dense_rows = NATIVE_INT8_DENSE_ROWS if self.dense_packed else NATIVE_INT8_FLOAT_DENSE_ROWS
            self.qweight, self.scales = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=ACT)
            if self.dense is not None:
                dense = self.dense.packed if self.dense_packed else self.dense.weight
                self.set_dense(self.dequantized().to(dense.dtype))
        else:
            self.groups = None

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x if x.dtype in _NATIVE_ACTS else x.to(ACT))
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K] in -127..127, d float16 [N, K/32]) for weight [N, K] (K a multiple of
    32): each group of 32 inputs of a row on 127 steps either side of zero, d its largest
    magnitude / 127 rounded to float16 and q = round(w / d). That is GGUF Q8_0's block, so a
    Q8_0 file's weights, dequantized to float32, give back exactly the file's d and q."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    d = (w.abs().amax(dim=2) / 127.0).to(torch.float16)
    step = d.float()[..., None]
    q = torch.where(step > 0, w / step, 0.0).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d.contiguous()


def int8_dequantized(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 weight d * q of `int8_groups`' codes and scales."""
    n, k = q.shape
    return (q.float().reshape(n, k // GROUP, GROUP) * d.float()[..., None]).reshape(n, k)


def int4_groups(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] in 0..15 as int32, scale [N, K/group], zero [N, K/group]): each group of
    `group` inputs of a row mapped onto 16 steps from its minimum to its maximum, in the
    kernel's terms w = (q - 8) · scale + zero."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo + 8.0 * scale


def int4_dequantized(weight: torch.Tensor, group: int = GROUP,
                     scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight int4 stands for: each value moved to its group's nearest step, with
    the groups' scale and zero point held in `scale_dtype` (the kernel's: `ACT`)."""
    n, k = weight.shape
    q, scale, zero = int4_groups(weight, group)
    s = scale.to(scale_dtype).float()[..., None]
    z = zero.to(scale_dtype).float()[..., None]
    return ((q.float().reshape(n, k // group, group) - 8.0) * s + z).reshape(n, k)


BLOCK = 16
"""Groups per block of `int4_blocks`' layout (one per 32-bit lane of a 512-bit register)."""


def int4_blocks(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit weight w = scale * q + low (q [N, K] in 0..15, K a multiple of 64; scale and
    low [N, K/32]: Q4_1's d and m) in the layout of the native kernel
    (kvserve/kernels/csrc/int4_mm.c): (nib uint8 [N, K/2], d float16 [N, K/32], m float16).

    Each row's codes, two to a byte, in blocks of 16 groups (512 inputs, 256 bytes): byte
    4j + t of the block's 64-byte chunk i holds input 8i + t of group j in its low nibble and
    input 8i + 4 + t in its high one, so that a chunk's low (high) nibbles are one 512-bit
    register with inputs 4u..4u+3 of every group in that group's 32-bit lane (u = 2i, 2i+1).
    The groups after the last whole block (an even number) go in pairs: byte t of a pair's 32
    holds input t of its first group low and of its second high."""
    n, k = q.shape
    if k % 64:
        raise ValueError(f"int4_blocks: K must be a multiple of 64, got {k}")
    q8 = q.to(torch.uint8)
    whole = k // (GROUP * BLOCK) * GROUP * BLOCK
    blocks = q8[:, :whole].reshape(n, whole // (GROUP * BLOCK), BLOCK, 4, 2, 4).permute(0, 1, 3, 4, 2, 5)
    blocks = (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).reshape(n, whole // 2)
    pairs = q8[:, whole:].reshape(n, (k - whole) // 64, 2, GROUP)
    pairs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, (k - whole) // 2)
    return torch.cat([blocks, pairs], 1).contiguous(), scale.to(torch.float16).contiguous(), \
        low.to(torch.float16).contiguous()


class Int4Linear(_WeightOnly):
    """Group-wise asymmetric int4 weight, packed for torch's CPU int4 kernel, and where K is a
    multiple of 64 also in `int4_blocks`' layout for a native kernel (`use_ops`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = GROUP) -> None:
        q, scale, zero = int4_groups(weight, group)
        self.group = group
        self.packed: torch.Tensor | None = torch._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=2).to(ACT).contiguous()  # [K/group, N, 2]
        self.bias = bias
        self.blocks = int4_blocks(q, scale, zero - 8.0 * scale) if group == GROUP and q.shape[1] % 64 == 0 else None

    def use_ops(self, ops: Any) -> None:
        """Multiply through `ops.Int4Weight(nib, d, m)` (a callable: bf16 or fp32 x [M, K] ->
        [M, N]) where `ops.int4_available()` holds, and free torch's packed copy; otherwise
        drop the blocks and keep torch's kernel. Once chosen, the choice stays (either copy
        is freed). A dense copy that is a plain float GEMM is freed too where
        `NATIVE_INT4_FLOAT_DENSE_ROWS` is None (the kernel is faster at every batch)."""
        if self.kernel is not None or self.blocks is None or self.packed is None:
            return
        if ops is not None and ops.int4_available():
            self.kernel = ops.Int4Weight(*self.blocks)
            self.packed, self.scales_and_zeros = None, torch.empty(0)
            if self.dense_packed:
                self.dense_rows = NATIVE_INT4_DENSE_ROWS
            elif NATIVE_INT4_FLOAT_DENSE_ROWS is None:
                self.dense = None  # the kernel takes every batch
            else:
                self.dense_rows = NATIVE_INT4_FLOAT_DENSE_ROWS
        else:
            self.blocks = None

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x if x.dtype in _NATIVE_ACTS else x.to(ACT))
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)


def auto_mode(weight_types: dict[str, int], device: str) -> str:
    """The mode `auto` picks for projection weights of these GGML types ({type name: tensors};
    empty for a float checkpoint) on `device`."""
    if not device.startswith("cpu") or not weight_types:
        return "none"
    bits4 = sum(n for t, n in weight_types.items() if t.startswith(("Q4", "IQ4")))
    bits8 = sum(n for t, n in weight_types.items() if t.startswith(("Q5", "Q6", "Q8")))
    if bits4 == 0 and bits8 == 0:
        return "none"  # F32, F16, BF16 (or types below 4 bits, which int4 would not keep)
    return "int4" if bits4 >= bits8 else "int8"


def supports(mode: str, weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can take `mode` (int4 needs K a multiple of the group and of the
    packing's tile; int8 K a multiple of 16: torch's int8 kernel gives NaN, garbage or a crash
    at others, K 24, 40, 56)."""
    k = weight.shape[1]
    if mode == "int4":
        return k % GROUP == 0 and k % (16 * _INNER_K_TILES) == 0
    return k % 16 == 0 if mode == "int8" else True


def quantize(mode: str, weight: torch.Tensor, bias: torch.Tensor | None, *,
             dense: bool = False, groups: bool = False) -> Linear | _WeightOnly:
    """The `Linear` for `weight` in `mode` (a weight int4 cannot take falls back to int8, one
    int8 cannot take stays float);
    `dense`: keep a copy of the quantized weight in `weight`'s dtype for large batches;
    `groups`: an int8 weight also keeps its groups of 32 for a native kernel
    (`Int8Linear.use_ops`)."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    if weight.device.type != "cpu" and mode != "none":
        raise ValueError(f"--quantization {mode} runs on CPU only (weights are on {weight.device})")
    lin: _WeightOnly
    if mode == "int4" and supports(mode, weight):
        lin = Int4Linear(weight, bias)
        grid = int4_dequantized(weight, scale_dtype=ACT) if dense else None
    elif mode in ("int4", "int8") and supports("int8", weight):
        lin = Int8Linear(weight, bias, groups=groups)
        grid = lin.dequantized() if dense else None
    else:
        return Linear(weight, bias, pack(weight) if dense else None)
    if grid is not None:
        lin.set_dense(grid.to(weight.dtype))
    return lin
