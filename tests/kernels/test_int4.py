"""The native 4-bit projection (csrc/int4_mm.c through native.Int4Weight): the layout of
quant.int4_blocks holds each weight's code, the kernel computes exactly the sum its 8-bit
activations and the weight's Q4_1 values stand for, each row on its own, stays within the
activations' rounding of the float product, refuses what it cannot take, and a model whose
projections go through it keeps its logits; in both its builds (AVX-512 VNNI and AVX2). A
build with neither has no 4-bit kernel and the model keeps torch's."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from kvserve.kernels import native
from kvserve.model.llama import PROJECTIONS
from kvserve.model.quant import GROUP, Int4Linear, int4_blocks, int4_groups
from tests.kernels import weightonly

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module", params=["native", "avx2"])
def lib(request):
    """This CPU's build and the AVX2 one, each skipped where it has no 4-bit kernel."""
    return weightonly.kernel_build(request.param, "kvs_int4_available")


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """A random weight's blocks and the float values they stand for (float16 d and m)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scale, zero = int4_groups(w)
    blocks = int4_blocks(q, scale, zero - 8.0 * scale)
    _, d, m = blocks
    grid = (q.double().reshape(n, k // GROUP, GROUP) * d.double()[..., None] + m.double()[..., None])
    return q, blocks, grid.reshape(n, k)


def unpack(nib: torch.Tensor, k: int) -> torch.Tensor:
    """int4_blocks' bytes back to codes [N, K], by its docstring's rule, one value at a time."""
    n = nib.shape[0]
    q = torch.empty(n, k, dtype=torch.int64)
    whole = k // 512 * 512
    for col in range(k):
        if col < whole:
            b, within = divmod(col, 512)
            j, rest = divmod(within, GROUP)  # group j of the block, input `rest` of it
            i, r8 = divmod(rest, 8)
            byte, shift = b * 256 + i * 64 + 4 * j + r8 % 4, 4 * (r8 // 4)
        else:
            p, within = divmod(col - whole, 64)
            half, t = divmod(within, GROUP)
            byte, shift = whole // 2 + p * 32 + t, 4 * half
        q[:, col] = (nib[:, byte].long() >> shift) & 15
    return q


@pytest.mark.parametrize("k", [64, 512, 576, 1536])
def test_blocks_hold_every_code(k: int) -> None:
    q, (nib, d, m), _ = weight(5, k, k)
    assert nib.dtype == torch.uint8 and nib.shape == (5, k // 2) and d.shape == m.shape == (5, k // 32)
    assert torch.equal(unpack(nib, k), q.long())
    with pytest.raises(ValueError, match="K must be a multiple of 64, got 96"):
        int4_blocks(torch.zeros(2, 96, dtype=torch.int32), torch.ones(2, 3), torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (33, 512), (96, 576), (17, 1536)])
def test_computes_the_sum_of_its_quantized_operands(lib, dtype, n, k) -> None:
    _, blocks, grid = weight(n, k, n + k)
    weightonly.check_exact_sums(lambda x: native.int4_mm(x, *blocks, lib=lib), grid, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_of_many_rows_is_each_row_alone(lib, dtype) -> None:
    """520 rows (quantized on several threads, many passes of rows through each block of
    outputs, a last pass of fewer rows): the exact sums, and every row as it is alone."""
    n, k = 70, 576
    _, blocks, grid = weight(n, k, 5)
    x = (torch.randn(520, k, generator=torch.Generator().manual_seed(520)) * 2).to(dtype)
    y = native.int4_mm(x, *blocks, lib=lib)
    want = weightonly.quantized_activations(x).double() @ grid.t()
    if dtype == torch.float32:
        assert (y.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    else:
        assert torch.allclose(y.double(), want, rtol=2**-8, atol=1e-6 * want.abs().max().item())
    for r in (0, 5, 6, 7, 257, 517, 519):
        assert torch.equal(native.int4_mm(x[r : r + 1], *blocks, lib=lib)[0], y[r])
    assert torch.equal(native.int4_mm(x[100:113], *blocks, lib=lib), y[100:113])


def test_stays_within_the_activations_rounding_of_the_float_product(lib) -> None:
    n, k = 64, 1536
    _, blocks, grid = weight(n, k, 7)
    weightonly.check_within_rounding(lambda x: native.int4_mm(x, *blocks, lib=lib), grid)


def test_the_projection_takes_any_float_dtype_and_batch_shape() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(5))
    lin = Int4Linear(w, None)
    lin.use_ops(native)
    if lin.kernel is None:
        pytest.skip("this CPU's build has no 4-bit kernel")
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(6))
    want = lin(x.reshape(6, 128)).reshape(2, 3, 48)
    assert torch.equal(lin(x), want)  # 3-D: the same rows
    half = lin(x.half())  # float16 goes through bfloat16, and comes back float16
    assert half.dtype == torch.float16 and half.shape == (2, 3, 48)
    assert torch.allclose(half.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_refuses_what_it_cannot_take(lib) -> None:
    _, (nib, d, m), _ = weight(8, 128, 1)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match=r"K a multiple of 64.*got nib \(8, 48\)"):
        native.int4_mm(torch.randn(2, 96), nib[:, :48].contiguous(), d[:, :3].contiguous(),
                       m[:, :3].contiguous(), lib=lib)
    with pytest.raises(ValueError, match=r"x \[M, 128\] bf16 or fp32 with contiguous rows, got x \(2, 64\)"):
        native.int4_mm(torch.randn(2, 64), nib, d, m, lib=lib)
    with pytest.raises(ValueError, match=r"nib \(8, 32\) torch.uint8"):
        native.int4_mm(x, nib[:, :32].contiguous(), d, m, lib=lib)
    with pytest.raises(ValueError, match=r"d \(8, 4\) torch.float32"):
        native.int4_mm(x, nib, d.float(), m, lib=lib)
    with pytest.raises(ValueError, match=r"got x \(2, 128\) torch.float64"):
        native.int4_mm(x.double(), nib, d, m, lib=lib)
    with pytest.raises(ValueError, match="contiguous rows"):
        native.int4_mm(x.t().contiguous().t(), nib, d, m, lib=lib)
    assert native.int4_mm(x[:0], nib, d, m, lib=lib).shape == (0, 8)


def test_a_build_without_avx2_has_no_4bit_kernel_and_the_projection_keeps_torchs() -> None:
    portable = native.build(("-mno-avx512f", "-mno-avx2"))
    assert portable is not None and portable.kvs_int4_available() == 0
    _, blocks, _ = weight(8, 128, 2)
    with pytest.raises(ValueError, match="this build has no 4-bit kernel"):
        native.int4_mm(torch.randn(1, 128), *blocks, lib=portable)

    class NoInt4:
        Int4Weight = native.Int4Weight

        @staticmethod
        def int4_available() -> bool:
            return False

    w = torch.randn(32, 128)
    lin = Int4Linear(w, None)
    x = torch.randn(3, 128)
    before = lin(x)
    lin.use_ops(NoInt4())
    assert lin.kernel is None and lin.blocks is None and lin.packed is not None  # torch's kernel, blocks freed
    assert torch.equal(lin(x), before)


def test_a_model_through_the_native_int4_keeps_its_logits(tmp_path) -> None:
    """use_row_ops(native) on an int4 model: every projection takes the native kernel (torch's
    packed copies freed), and its logits stay those of torch's int4 kernel up to the 8-bit
    activations."""
    model = weightonly.tiny_model(tmp_path, torch.bfloat16, "int4")
    plain = weightonly.six_token_logits(model)
    if not native.int4_available():
        pytest.skip("this CPU's build has no 4-bit kernel")
    model.use_row_ops(native)
    lins = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
    assert all(isinstance(lin, Int4Linear) and isinstance(lin.kernel, native.Int4Weight) and lin.packed is None
               for lin in lins)
    weightonly.check_close_logits(weightonly.six_token_logits(model), plain, 0.05)  # another kernel: 8-bit activations


def test_a_float32_model_frees_the_int4_dense_copies_and_keeps_the_heads_to_its_rows(tmp_path) -> None:
    """float32 dense copies are plain GEMMs (`pack` takes bf16 only): the int8 head keeps its
    kernel to HEAD_FLOAT_DENSE_ROWS rows and takes its dense copy above; the native int4
    projections free theirs (NATIVE_INT4_FLOAT_DENSE_ROWS is None: the kernel is faster at
    every batch) and take a prefill's rows too, as the one-call layer takes any decode step."""
    from kvserve.model.quant import HEAD_FLOAT_DENSE_ROWS, NATIVE_INT4_FLOAT_DENSE_ROWS
    from kvserve.model.weights import load_model
    from tests.model.tinymodel import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    model = load_model(str(path), dtype=torch.float32, quantization="int4").model
    head = model.head
    assert head.dense.packed is None and head.dense_rows == HEAD_FLOAT_DENSE_ROWS == 64
    x = torch.randn(HEAD_FLOAT_DENSE_ROWS + 1, 64, generator=torch.Generator().manual_seed(7))
    assert torch.equal(head(x), head.dense(x))
    assert torch.equal(head(x[:-1]), head._mm(x[:-1].to(torch.bfloat16)).float())
    lin = model.layers[0].gate_up
    assert lin.dense is not None and lin.dense.packed is None  # until the native kernel is chosen
    if not native.int4_available():
        pytest.skip("this CPU's build has no 4-bit kernel")
    model.use_row_ops(native)
    assert NATIVE_INT4_FLOAT_DENSE_ROWS is None
    assert all(getattr(layer, name).dense is None for layer in model.layers for name in PROJECTIONS)
    assert lin.kernel_rows == math.inf and model.fused_rows == math.inf
    x = torch.randn(600, 64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(lin(x), lin.kernel(x))
