"""Weight-only quantization on CPU (kvserve.model.quant): each kernel computes x @ W.T with the
weight its format stands for; int4 reproduces a Q4_1-quantized weight exactly (a Q4_1 GGUF is
served as shipped); a quantized model frees its float projections and its logits stay close
to the float model's; the modes and the config agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.config import ConfigError
from kvserve.config.runner import QUANTIZATIONS, RunnerConfig
from kvserve.model.dense import Linear, pack
from kvserve.model.quant import (
    ACT,
    DENSE_ROWS,
    MODES,
    Int4Linear,
    Int8Linear,
    auto_mode,
    int4_dequantized,
    quantize,
)
from kvserve.model.weights import resolve_quantization

from .tinymodel import write_tiny_model


def test_modes_are_the_configs() -> None:
    assert QUANTIZATIONS == ("auto", *MODES)


@pytest.mark.parametrize(("types", "device", "mode"), [
    ({"Q4_1": 210}, "cpu", "int4"),  # the default model
    ({"Q4_K": 150, "Q6_K": 60}, "cpu", "int4"),  # a Q4_K_M file keeps some layers at 6 bits
    ({"Q4_0": 10, "Q8_0": 20}, "cpu", "int8"),
    ({"Q8_0": 210}, "cpu", "int8"),
    ({"Q5_K": 210}, "cpu", "int8"),
    ({"F16": 210}, "cpu", "none"),
    ({"BF16": 100, "F32": 10}, "cpu", "none"),
    ({"Q2_K": 210}, "cpu", "none"),  # below 4 bits: int4 would not keep it
    ({}, "cpu", "none"),  # a Hugging Face directory
    ({"Q4_1": 210}, "cuda:0", "none"),
])
def test_auto_follows_the_files_weight_types(types: dict[str, int], device: str, mode: str) -> None:
    assert auto_mode(types, device) == mode


def test_auto_resolves_from_the_model_file(tmp_path) -> None:
    assert resolve_quantization("auto", None, "cpu") == "int4"  # the embedded Q4_1 GGUF
    assert resolve_quantization("auto", None, "cuda") == "none"
    tiny = write_tiny_model(tmp_path / "tiny")
    assert resolve_quantization("auto", str(tiny), "cpu") == "none"
    assert resolve_quantization("int8", str(tiny), "cpu") == "int8"
    assert resolve_quantization("none", None, "cpu") == "none"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_computes_with_its_own_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = quantize("int8", w.to(dtype), b.to(dtype))
    assert isinstance(lin, Int8Linear) and lin.qweight.dtype == torch.int8
    deq, wd = lin.dequantized(), w.to(dtype).float()
    # each weight within half a step of its row, plus the rounding of the row's scale to bf16
    amax = wd.abs().amax(1, keepdim=True)
    assert ((deq - wd).abs() <= amax / 254 + amax * 2.0**-8).all()
    x = torch.randn(5, 64)
    got = lin(x.to(dtype))
    assert got.dtype == dtype
    # the kernel runs on bf16 activations and gives bf16 outputs (8 significant bits)
    want = x.to(ACT).float() @ deq.t() + b.to(dtype).float()
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item()), \
        (got.float() - want).abs().max()


def test_int4_keeps_a_q4_1_weights_codes() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    shipped = torch.from_numpy(dequantize(gguf_quantize(w, GGMLQuantizationType.Q4_1),
                                          GGMLQuantizationType.Q4_1).reshape(64, 128).copy())
    assert not torch.equal(shipped, torch.from_numpy(w))  # it is quantized
    # with exact scales, back onto its own grid: the 4-bit codes are the file's
    err = (int4_dequantized(shipped) - shipped).abs().max().item()
    assert err < 1e-5, err
    # while a float weight loses up to half a step
    assert (int4_dequantized(torch.from_numpy(w)) - torch.from_numpy(w)).abs().max().item() > 1e-2
    # the kernel's bf16 scale and zero point move a weight by at most their rounding
    kernel = int4_dequantized(shipped, scale_dtype=ACT)
    bound = shipped.abs().amax() * 2.0**-7
    assert 0 < (kernel - shipped).abs().max().item() <= bound


def test_int4_kernel_computes_with_the_grid_weight() -> None:
    torch.manual_seed(2)
    w = torch.randn(128, 256)
    lin = quantize("int4", w, None)
    assert isinstance(lin, Int4Linear)
    x = torch.randn(7, 256)
    want = x.to(ACT).float() @ int4_dequantized(w, scale_dtype=ACT).t()
    got = lin(x)
    assert got.dtype == torch.float32
    # bf16 output: 8 significant bits of values ~|want|
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()), (got - want).abs().max()
    # batch shape is kept
    assert lin(x.view(7, 1, 256)).shape == (7, 1, 128)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_no_rows_give_no_rows(mode: str) -> None:
    """A step whose requests are all mid-prefill asks the head for no logits: [0, K] -> [0, N]
    (the runner died of a reshape of it before)."""
    lin = quantize(mode, torch.randn(96, 64), None, dense=True)
    assert lin(torch.randn(0, 64)).shape == (0, 96)
    assert lin(torch.randn(2, 0, 64)).shape == (2, 0, 96)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_large_batches_take_the_dense_copy_of_the_same_weights(mode: str) -> None:
    torch.manual_seed(3)
    w = torch.randn(96, 128, dtype=torch.bfloat16)
    lin = quantize(mode, w, None, dense=True)
    assert lin.dense is not None
    grid = int4_dequantized(w, scale_dtype=ACT) if mode == "int4" else lin.dequantized()
    eye = torch.eye(128, dtype=torch.bfloat16)
    assert torch.equal(lin.dense(eye).t(), grid.to(torch.bfloat16))  # the kernel's values, not w's
    rows = DENSE_ROWS
    big = torch.randn(rows + 1, 128, dtype=torch.bfloat16)
    assert torch.equal(lin(big), lin.dense(big))
    small = big[:rows]
    kernel = lin._mm(small)
    assert torch.equal(lin(small), kernel)  # few rows: the weight-only kernel
    ref = small.float() @ grid.float().t()
    for y in (kernel, lin(big)[:rows]):
        assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert quantize(mode, w, None).dense is None


def test_packed_linear_equals_the_plain_one_for_any_input_shape() -> None:
    torch.manual_seed(4)
    w, b = torch.randn(96, 128, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    packed = pack(w)
    if packed is None:
        pytest.skip("no native bfloat16 GEMM on this CPU: pack() keeps the plain path")
    lin = Linear(torch.empty(0, dtype=torch.bfloat16), b, packed)  # the float weight dropped
    for x in (torch.randn(5, 128, dtype=torch.bfloat16), torch.randn(2, 3, 128, dtype=torch.bfloat16),
              torch.randn(4, 128), torch.randn(0, 128, dtype=torch.bfloat16)):
        y, ref = lin(x), torch.nn.functional.linear(x.to(torch.bfloat16), w, b).to(x.dtype)
        assert y.shape == ref.shape and y.dtype == x.dtype
        assert torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2), (x.shape, x.dtype)
    assert pack(w.float()) is None and pack(torch.randn(3, 4, 5, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize(("k", "n"), [(576, 960), (576, 3072), (1536, 576), (576, 49152)],
                         ids=["qkv", "gate_up", "down", "head"])  # the default model's shapes
def test_a_packed_linear_gives_a_row_the_same_bits_in_any_batch(k: int, n: int) -> None:
    """Each row's result is the same bits alone (one row, which oneDNN runs on another kernel),
    in a small batch, a large one, at any position and in any order (issue 36: batch
    invariance of the bf16 dense path)."""
    torch.manual_seed(k + n)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    packed = pack(w)
    if packed is None:
        pytest.skip("no native bfloat16 GEMM on this CPU: pack() keeps the plain path")
    lin = Linear(w, None, packed)
    x = torch.randn(300, k, dtype=torch.bfloat16)
    alone = torch.cat([lin(x[r : r + 1]) for r in range(x.shape[0])])
    order = torch.randperm(x.shape[0])
    calls = [(x[:m], torch.arange(m)) for m in (2, 3, 7, 8, 17, 64)] + [(x[5:300], torch.arange(5, 300)),
                                                                      (x[order], order)]
    for rows, which in calls:
        got = lin(rows)
        moved = [int(r) for i, r in enumerate(which) if not torch.equal(got[i], alone[r])]
        assert not moved, f"{rows.shape[0]} rows: rows {moved[:8]} differ from themselves alone"


def test_int4_falls_back_to_int8_where_k_does_not_tile() -> None:
    assert isinstance(quantize("int4", torch.randn(16, 48), None), Int8Linear)
    assert type(quantize("none", torch.randn(16, 48), None)) is Linear
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4, got 'fp8'"):
        quantize("fp8", torch.randn(16, 48), None)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_model_stays_close_and_frees_its_float_projections(tmp_path, mode: str) -> None:
    from kvserve.model.weights import load_model

    path = write_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)  # K tiles for int4
    ref = load_model(str(path), dtype=torch.float32)
    q = load_model(str(path), dtype=torch.float32, quantization=mode)
    assert q.model.quantization == mode and isinstance(q.model.head, Int8Linear)
    layer = q.model.layers[0]
    assert layer.qkv_weight.numel() == 0 and layer.down_weight.numel() == 0
    assert layer.down.dense is not None and q.model.head.dense is not None  # for large batches
    assert isinstance(layer.gate_up, Int4Linear if mode == "int4" else Int8Linear)
    ids = torch.arange(3, 40)

    def dense(model):
        def attend(_, qh, k, v):
            qh, k, v = (t.transpose(0, 1) for t in (qh, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
            return o.transpose(0, 1)
        return model.forward_tokens(ids, torch.arange(len(ids)), attend, torch.arange(len(ids)))

    a, b = dense(ref.model), dense(q.model)
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < (0.02 if mode == "int8" else 0.2), rel
    assert rel > 0  # it is quantized


def test_config_checks_the_mode() -> None:
    assert RunnerConfig(quantization="int4").quantization == "int4"
    assert RunnerConfig().quantization == "auto"
    assert RunnerConfig(quantization="auto", device="cuda").quantization == "auto"
    with pytest.raises(ConfigError, match="^--quantization: 'int3' is not one of auto, none, int8, int4"):
        RunnerConfig(quantization="int3")
    with pytest.raises(ConfigError, match="^--quantization int8: runs on CPU only"):
        RunnerConfig(quantization="int8", device="cuda:0")


def test_a_bf16_models_packed_head_takes_its_dense_copy_above_four_rows(tmp_path) -> None:
    from kvserve.model.quant import HEAD_DENSE_ROWS
    from kvserve.model.weights import load_model

    if pack(torch.randn(96, 128, dtype=torch.bfloat16)) is None:
        pytest.skip("no native bfloat16 GEMM on this CPU: the head keeps the int8 kernel to DENSE_ROWS")
    path = write_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    head = load_model(str(path), dtype=torch.bfloat16, quantization="int4").model.head
    assert head.dense_rows == HEAD_DENSE_ROWS == 4 and layer_rows() == DENSE_ROWS
    x = torch.randn(HEAD_DENSE_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(head(x), head.dense(x))
    assert torch.equal(head(x[:HEAD_DENSE_ROWS]), head._mm(x[:HEAD_DENSE_ROWS]))


def layer_rows() -> int:
    from kvserve.model.quant import _WeightOnly

    return _WeightOnly.dense_rows


def test_a_load_resolves_auto_and_parses_the_gguf_header_once(monkeypatch) -> None:
    """The embedded Q4_1 file: `load_model(quantization="auto")` runs int4 and says so, and its
    header (seconds to parse: every vocabulary string) is opened once for the mode, the
    weights and the tokenizer, where it was opened three times."""
    from kvserve.model import gguf as ggufload
    from kvserve.model.weights import load_model

    opened = []
    real = ggufload.open_reader
    monkeypatch.setattr(ggufload, "open_reader", lambda path: opened.append(path) or real(path))
    loaded = load_model(None, quantization="auto")
    assert loaded.quantization == "int4"
    assert isinstance(loaded.model.layers[0].gate_up, Int4Linear)
    assert len(opened) == 1


@pytest.mark.parametrize(("k", "kind"), [(24, Linear), (40, Linear), (56, Linear), (48, Int8Linear)])
def test_a_weight_int8_cannot_take_stays_float(k: int, kind: type) -> None:
    # torch's int8 kernel gives NaN, garbage or a crash where K is not a multiple of 16
    weight = torch.randn(32, k, generator=torch.Generator().manual_seed(k))
    for mode in ("int8", "int4"):
        lin = quantize(mode, weight, None)
        assert isinstance(lin, kind), (mode, k)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
        got = lin(x)
        assert bool(torch.isfinite(got).all())
        assert ((got - x @ weight.T).norm() / (x @ weight.T).norm()).item() < 0.02
