"""A decoder layer in one native call (csrc/decode_layer.c through native.DecodeStep): an int4
model's decode steps of a few rows take it, and give the logits and the K/V of the layer's
separate calls (float32: to float rounding; bf16: to a last-place rounding of the SiLU);
prefill steps, steps past the projections' dense rows and other backends keep the separate
calls; positions, slots, rows and lengths out of bounds are refused by name (nothing stored
for a position or a slot; the attention's bounds are checked after the store, as in the
separate calls)."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvserve.kernels import get_backend, native
from tests.model.tinymodel import PagedKV, write_tiny_model

pytestmark = [
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler"),
    pytest.mark.skipif(not native.int4_available(), reason="no 4-bit kernel in this CPU's build"),
]

PROMPTS = ([5, 9, 11, 3, 7, 2, 8], [4, 4, 6], [12, 1, 1, 10, 13, 2, 5, 6, 9, 3, 7])


def tiny_int4(tmp_path, dtype: torch.dtype, **config):
    from kvserve.model.weights import load_model

    path = write_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128, **config)
    model = load_model(str(path), dtype=dtype, quantization="int4").model
    model.use_row_ops(native)
    return model


def prefilled(model, dtype: torch.dtype) -> PagedKV:
    kv = PagedKV(model.config, max_reqs=4, max_len=32, dtype=dtype)
    kv.forward(model, get_backend("torch"), [list(p) for p in PROMPTS], rows=[0, 1, 2], prefix_lens=[0, 0, 0])
    return kv


def decode(model, kv: PagedKV, fused: bool, fence=None) -> torch.Tensor:
    """One decode step of the three requests, through one call per layer or the separate ones."""
    rows = model.fused_rows
    if not fused:
        model.fused_rows = 0
    try:
        return kv.forward(model, get_backend("torch"), [[3], [8], [1]], rows=[0, 1, 2],
                          prefix_lens=[len(p) for p in PROMPTS], fence=fence)
    finally:
        model.fused_rows = rows


@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the attention's vector path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_in_one_call_per_layer_gives_the_separate_calls_numbers(tmp_path, dtype, head_dim,
                                                                              monkeypatch) -> None:
    model = tiny_int4(tmp_path, dtype, num_heads=64 // head_dim * 2, num_kv_heads=64 // head_dim, head_dim=head_dim)
    assert all(isinstance(layer.fused, native.DecodeLayer) for layer in model.layers)
    assert model.fused_rows == min(getattr(layer, name).kernel_rows for layer in model.layers
                                   for name in ("qkv", "o", "gate_up", "down"))
    separate_kv = prefilled(model, dtype)
    separate = decode(model, separate_kv, fused=False)
    calls = []
    run = native.DecodeStep.run
    monkeypatch.setattr(native.DecodeStep, "run", lambda self, *a: calls.append(1) or run(self, *a))
    fused_kv = prefilled(model, dtype)
    slots = [1 + r * 32 + len(p) for r, p in enumerate(PROMPTS)]  # PagedKV: row r from slot 1 + 32 r
    fenced = []

    def fence(layer: int) -> None:  # the lease check comes before each layer's store
        fenced.append(layer)
        assert torch.count_nonzero(fused_kv.k_buffer[layer, slots]) == 0

    fused = decode(model, fused_kv, fused=True, fence=fence)
    assert len(calls) == model.config.num_layers and fenced == list(range(model.config.num_layers))
    if dtype == torch.float32:  # the same kernels in the same order: only the SiLU's exp differs
        torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
        for a, b in ((fused_kv.k_buffer, separate_kv.k_buffer), (fused_kv.v_buffer, separate_kv.v_buffer)):
            torch.testing.assert_close(a[:, slots], b[:, slots], rtol=1e-5, atol=1e-6)
    else:  # a SiLU a last place off moves a bf16 rounding now and then
        assert ((fused - separate).norm() / separate.norm()).item() < 0.02
        assert torch.equal(fused.argmax(-1), separate.argmax(-1))
        assert torch.equal(fused_kv.k_buffer[0, slots], separate_kv.k_buffer[0, slots])  # layer 0: before any SiLU
    assert torch.count_nonzero(fused_kv.k_buffer[:, slots]) > 0


def test_prefills_large_steps_and_other_backends_keep_the_separate_calls(tmp_path, monkeypatch) -> None:
    model = tiny_int4(tmp_path, torch.float32)
    calls = []
    run = native.DecodeStep.run
    monkeypatch.setattr(native.DecodeStep, "run", lambda self, *a: calls.append(1) or run(self, *a))
    kv = prefilled(model, torch.float32)  # a prefill step
    assert calls == []
    kv.forward(model, get_backend("reference"), [[3], [8], [1]], rows=[0, 1, 2],
               prefix_lens=[len(p) for p in PROMPTS])
    assert calls == []
    model.fused_rows = 2  # three decode rows are past it
    decode(model, kv, fused=True)
    assert calls == []
    model.fused_rows = 3
    kv.forward(model, get_backend("torch"), [[5], [6], [7]], rows=[0, 1, 2],
               prefix_lens=[len(p) + 1 for p in PROMPTS])
    assert len(calls) == model.config.num_layers


def step_for(model, kv: PagedKV, **change):
    cfg = model.config
    args = dict(positions=torch.tensor([7]), loc=torch.tensor([8]), req_to_token=kv.req_to_token,
                rows=torch.tensor([0]), lens=torch.tensor([8]), cos=model.rotary.cos, sin=model.rotary.sin,
                sm_scale=model.sm_scale, pool_size=kv.k_buffer.shape[1])
    args.update(change)
    dims = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
    return native.DecodeStep(dims, **args)


@pytest.mark.parametrize(("change", "message"), [
    ({"positions": torch.tensor([100_000])}, "position 100000 of token 0 is outside the rotary tables"),
    ({"loc": torch.tensor([10**6])}, "slot 1000000 of token 0 is outside the pool"),
    ({"rows": torch.tensor([99])}, "token 0 names row 99 of req_to_token"),
    ({"lens": torch.tensor([33])}, "token 0 names row 0 of req_to_token or a length outside its bounds"),
])
def test_out_of_bounds_inputs_are_named(tmp_path, change, message) -> None:
    model = tiny_int4(tmp_path, torch.float32)
    kv = prefilled(model, torch.float32)
    before_k, before_v = kv.k_buffer.clone(), kv.v_buffer.clone()
    x = torch.randn(1, model.config.hidden_size)
    stored = "rows" in change or "lens" in change  # the store comes before the attention's checks
    with pytest.raises(ValueError, match=message):
        step_for(model, kv, **change).run(model.layers[0].fused, x, kv.k_buffer[0], kv.v_buffer[0])
    assert torch.equal(kv.k_buffer[1:], before_k[1:]) and torch.equal(kv.v_buffer[1:], before_v[1:])
    assert torch.equal(kv.k_buffer[0], before_k[0]) != stored


def test_a_slot_outside_the_pool_in_a_requests_row_is_named(tmp_path) -> None:
    model = tiny_int4(tmp_path, torch.float32)
    kv = prefilled(model, torch.float32)
    kv.req_to_token[0, 3] = 10**6
    with pytest.raises(ValueError, match="token 0's request has a slot outside the pool"):
        step_for(model, kv).run(model.layers[0].fused, torch.randn(1, 64), kv.k_buffer[0], kv.v_buffer[0])


def test_a_model_the_one_call_layer_does_not_take_keeps_the_separate_calls(tmp_path) -> None:
    """float16 (the kernels take bf16 and fp32) and a q-head group past the attention's
    limit: use_row_ops leaves the layers as they were, and the model still decodes."""
    for name, dtype, config in (("f16", torch.float16, {}),
                                ("group", torch.float32, {"num_heads": 16, "num_kv_heads": 1, "head_dim": 16})):
        model = tiny_int4(tmp_path / name, dtype, **config)
        assert model.fused_rows == 0 and all(layer.fused is None for layer in model.layers)
        kv = prefilled(model, dtype)
        logits = decode(model, kv, fused=True)
        assert logits.shape == (3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_refuses_what_does_not_fit(tmp_path) -> None:
    model = tiny_int4(tmp_path, torch.float32)
    kv = prefilled(model, torch.float32)
    layer = model.layers[0].fused
    with pytest.raises(ValueError, match=r"x \[1, 64\] and caches"):
        step_for(model, kv).run(layer, torch.randn(2, 64), kv.k_buffer[0], kv.v_buffer[0])
    with pytest.raises(ValueError, match="contiguous on the CPU in the layer's torch.float32"):
        step_for(model, kv).run(layer, torch.randn(1, 64, dtype=torch.bfloat16), kv.k_buffer[0], kv.v_buffer[0])
    with pytest.raises(ValueError, match="int64 positions"):
        step_for(model, kv, rows=torch.tensor([0], dtype=torch.int32))
    lins = [getattr(model.layers[0], name).kernel for name in ("qkv", "o", "gate_up", "down")]
    norm = model.layers[0].input_norm.weight
    with pytest.raises(ValueError, match="do not fit heads=8"):
        native.DecodeLayer(norm, norm, 1e-5, *lins, heads=8, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="norm weights must be contiguous"):
        native.DecodeLayer(norm, norm.to(torch.bfloat16), 1e-5, *lins, heads=4, kv_heads=2, head_dim=16)
