"""The native 8-bit head (csrc/int8_mm.c through native.Int8Weight): quant.int8_groups gives
back a Q8_0 file's codes and scales, the kernel computes exactly the sum its 8-bit
activations and the weight's groups stand for, each row on its own, stays within the
activations' rounding of the float product, refuses what it cannot take, and a model whose
head goes through it keeps its logits and its dense copy; in both its builds (AVX-512 VNNI
and AVX2). A build with neither has no 8-bit kernel and the head keeps torch's."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvserve.kernels import native
from kvserve.model.quant import (
    GROUP,
    NATIVE_INT8_FLOAT_DENSE_ROWS,
    Int8Linear,
    int8_dequantized,
    int8_groups,
)
from tests.kernels import weightonly

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module", params=["native", "avx2"])
def lib(request):
    """This CPU's build and the AVX2 one, each skipped where it has no 8-bit kernel."""
    return weightonly.kernel_build(request.param, "kvs_int8_available")


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes over the whole int8 range (-128 included), float16 group scales, and the
    float64 weight they stand for."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0, :GROUP] = 127  # a group at the top of the range
    q[-1, -GROUP:] = -128  # and one at the bottom
    d = (torch.rand(n, k // GROUP, generator=gen) * 1e-3).to(torch.float16)
    grid = (q.double().reshape(n, k // GROUP, GROUP) * d.double()[..., None]).reshape(n, k)
    return q, d, grid


def test_groups_give_back_a_q8_0_files_codes_and_scales() -> None:
    from gguf import GGMLQuantizationType, quants

    w = (np.random.default_rng(0).standard_normal((6, 96)) * 0.05).astype(np.float32)
    w[1, 32:64] = 0  # a group of zeros: scale 0
    blocks = quants.quantize(w, GGMLQuantizationType.Q8_0).reshape(6, 3, 34)  # float16 d, 32 int8 q
    file_d = torch.from_numpy(blocks[..., :2].copy().view(np.float16).reshape(6, 3))
    file_q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(6, 96))
    loaded = torch.from_numpy(quants.dequantize(blocks.reshape(6, 102), GGMLQuantizationType.Q8_0))
    q, d = int8_groups(loaded)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and q.is_contiguous() and d.is_contiguous()
    assert torch.equal(q, file_q) and torch.equal(d, file_d)
    assert torch.equal(int8_dequantized(q, d), loaded)


def test_groups_round_each_weight_to_its_groups_nearest_step() -> None:
    w = torch.randn(7, 160, generator=torch.Generator().manual_seed(1)) * 0.1
    q, d = int8_groups(w)
    step = d.float().repeat_interleave(GROUP, 1)
    assert torch.equal(d, (w.reshape(7, 5, GROUP).abs().amax(-1) / 127).to(torch.float16))
    assert torch.equal(q.float().abs().reshape(7, 5, GROUP).amax(-1), torch.full((7, 5), 127.0))
    assert ((int8_dequantized(q, d) - w).abs() <= step / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 32), (33, 96), (96, 576), (17, 544), (9, 1536)])
def test_computes_the_sum_of_its_quantized_operands(lib, dtype, n, k) -> None:
    q, d, grid = weight(n, k, n + k)
    weightonly.check_exact_sums(lambda x: native.int8_mm(x, q, d, lib=lib), grid, dtype)


def test_stays_within_the_activations_rounding_of_the_float_product(lib) -> None:
    n, k = 64, 1536
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.05
    q, d = int8_groups(w)
    grid = int8_dequantized(q, d).double()
    weightonly.check_within_rounding(lambda x: native.int8_mm(x, q, d, lib=lib), grid)


def test_refuses_what_it_cannot_take(lib) -> None:
    q, d, _ = weight(8, 128, 1)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match=r"K a multiple of 32.*got q \(8, 48\)"):
        native.int8_mm(torch.randn(2, 48), q[:, :48].contiguous(), d[:, :1].contiguous(), lib=lib)
    with pytest.raises(ValueError, match=r"x \[M, 128\] bf16 or fp32 with contiguous rows, got x \(2, 64\)"):
        native.int8_mm(torch.randn(2, 64), q, d, lib=lib)
    with pytest.raises(ValueError, match=r"q \(8, 128\) torch.uint8"):
        native.int8_mm(x, q.view(torch.uint8), d, lib=lib)
    with pytest.raises(ValueError, match=r"d \(8, 4\) torch.float32"):
        native.int8_mm(x, q, d.float(), lib=lib)
    with pytest.raises(ValueError, match=r"d \(8, 2\) torch.float16"):
        native.int8_mm(x, q, d[:, :2].contiguous(), lib=lib)
    with pytest.raises(ValueError, match=r"q int8 \[N, K\]"):
        native.int8_mm(x, q.t(), d, lib=lib)  # not row-major
    with pytest.raises(ValueError, match=r"got x \(2, 128\) torch.float64"):
        native.int8_mm(x.double(), q, d, lib=lib)
    with pytest.raises(ValueError, match="contiguous rows"):
        native.int8_mm(x.t().contiguous().t(), q, d, lib=lib)
    assert native.int8_mm(x[:0], q, d, lib=lib).shape == (0, 8)


def test_a_build_without_avx2_has_no_8bit_kernel_and_the_head_keeps_torchs() -> None:
    portable = native.build(("-mno-avx512f", "-mno-avx2"))
    assert portable is not None and portable.kvs_int8_available() == 0
    q, d, _ = weight(8, 128, 2)
    with pytest.raises(ValueError, match="this build has no 8-bit kernel"):
        native.int8_mm(torch.randn(1, 128), q, d, lib=portable)

    class NoInt8:
        Int8Weight = native.Int8Weight

        @staticmethod
        def int8_available() -> bool:
            return False

    head = Int8Linear(torch.randn(32, 128), None, groups=True)
    x = torch.randn(3, 128)
    before = head(x)
    head.use_ops(NoInt8())
    assert head.kernel is None and head.groups is None  # the groups freed
    assert head.qweight.numel() == 32 * 128  # torch's kernel kept
    assert torch.equal(head(x), before)


def test_the_head_takes_any_float_dtype_and_batch_shape_and_its_dense_copy_is_the_groups() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(5))
    head = Int8Linear(w, None, groups=True)
    head.set_dense(head.dequantized())  # torch's per-row grid, as quant.quantize keeps it
    assert Int8Linear(w, None).groups is None and Int8Linear(w[:, :112], None, groups=True).groups is None
    head.use_ops(native)
    if head.kernel is None:
        pytest.skip("this CPU's build has no 8-bit kernel")
    assert head.dense_rows == NATIVE_INT8_FLOAT_DENSE_ROWS  # the projections' switch, until the model sets the head's
    head.dense_rows = 4
    assert isinstance(head.kernel, native.Int8Weight) and head.qweight.numel() == 0  # torch's copy freed
    grid = int8_dequantized(*head.groups)
    assert torch.equal(head.dequantized(), grid)
    assert torch.equal(head.dense.weight, grid)  # the values the kernel computes with
    x = torch.randn(2, 2, 128, generator=torch.Generator().manual_seed(6))
    want = head(x.reshape(4, 128)).reshape(2, 2, 48)
    assert torch.equal(want.reshape(4, 48), native.int8_mm(x.reshape(4, 128), *head.groups))
    assert torch.equal(head(x), want)  # 3-D: the same rows
    half = head(x.half())  # float16 goes through bfloat16, and comes back float16
    assert half.dtype == torch.float16 and half.shape == (2, 2, 48)
    assert torch.allclose(half.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    many = torch.randn(5, 128, generator=torch.Generator().manual_seed(7))  # above dense_rows
    assert torch.equal(head(many), head.dense(many))
    kernel = torch.cat([head(many[:4]), head(many[4:])])  # the same weight, 8-bit activations
    assert ((kernel - head(many)).norm() / head(many).norm()).item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_through_the_native_int8_head_keeps_its_logits(tmp_path, dtype) -> None:
    """use_row_ops(native, batch_invariant=False) on a quantized model: the head takes the
    native kernel (torch's per-row copy freed, the dense copy now its groups' values) with its
    own switch to the dense copy, and its logits stay those of torch's int8 head up to the
    8-bit activations and the finer scales."""
    from kvserve.model.quant import HEAD_DENSE_ROWS, NATIVE_HEAD_FLOAT_DENSE_ROWS
    from kvserve.model.weights import load_model
    from tests.model.tinymodel import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    model = load_model(str(path), dtype=dtype, quantization="int8").model
    head = model.head
    assert isinstance(head, Int8Linear) and head.groups is not None and head.kernel is None
    x = model.norm(torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(dtype))
    plain = head(x).float()
    if not native.int8_available():
        pytest.skip("this CPU's build has no 8-bit kernel")
    model.use_row_ops(native, batch_invariant=False)
    assert isinstance(head.kernel, native.Int8Weight) and head.qweight.numel() == 0 and model.head is head
    want_rows = HEAD_DENSE_ROWS if head.dense_packed else NATIVE_HEAD_FLOAT_DENSE_ROWS
    assert head.dense_rows == want_rows
    if not head.dense_packed:
        assert torch.equal(head.dense.weight, int8_dequantized(*head.groups).to(dtype))
    fast = head(x).float()
    assert torch.equal(fast, native.int8_mm(x, *head.groups).float())
    assert not torch.equal(fast, plain)  # another kernel
    assert ((fast - plain).norm() / plain.norm()).item() < 0.02
    many = model.norm(torch.randn(want_rows + 1, 64, generator=torch.Generator().manual_seed(4)).to(dtype))
    assert torch.equal(head(many), head.dense(many))
    model.use_row_ops(native, batch_invariant=False)  # again (the choice stays)
    assert head.kernel is not None and head.dense_rows == want_rows


def test_an_int8_models_projections_take_the_native_kernel_and_keep_their_logits(tmp_path) -> None:
    """use_row_ops(native) on an int8 model (a Q8_0 file's `auto`): every projection takes the
    native kernel (torch's per-row copy freed, the projections' switch to the dense copy), the
    layers keep their separate calls (the one-call layer takes int4 only), and the logits stay
    those of torch's int8 kernels up to the 8-bit activations and the finer scales."""
    from kvserve.model.llama import PROJECTIONS

    model = weightonly.tiny_model(tmp_path, torch.float32, "int8")
    plain = weightonly.six_token_logits(model)
    if not native.int8_available():
        pytest.skip("this CPU's build has no 8-bit kernel")
    model.use_row_ops(native)
    lins = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
    assert all(isinstance(lin, Int8Linear) and isinstance(lin.kernel, native.Int8Weight)
               and lin.qweight.numel() == 0 and lin.dense_rows == NATIVE_INT8_FLOAT_DENSE_ROWS for lin in lins)
    assert model.fused_rows == 0 and all(layer.fused is None for layer in model.layers)
    weightonly.check_close_logits(weightonly.six_token_logits(model), plain, 0.05)
