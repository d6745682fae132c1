"""The mixture-of-experts block (kvserve.model.moe) on the default path's numbers: a request's
logits do not depend on the other requests in its step (which experts they pick, how many rows
each expert's GEMM gets), bitwise, with the experts as 4-bit codes on the native kernels."""

from __future__ import annotations

import pytest
import torch

from kvserve.config.devices import cpu_has_native_bf16
from kvserve.kernels import get_backend, native
from kvserve.model.quant import Int4Linear
from kvserve.model.weights import load_model

from .tinymodel import PagedKV, causal_attention, write_tiny_model

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}


@pytest.mark.skipif(not native.available(), reason="the native CPU kernels did not build here")
def test_a_request_gets_the_same_logits_whatever_experts_the_others_pick(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "m", family="qwen3_moe", hidden_size=64, intermediate_size=128, extra=MOE)
    dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    model = load_model(str(path), dtype=dtype, quantization="int4").model
    model.use_row_ops(native)
    assert all(isinstance(lin, Int4Linear) for layer in model.layers for lin in layer.moe.linears())
    backend = get_backend("torch")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 1, 17, 4, 30)]
    alone = []
    for p in prompts:
        kv = PagedKV(model.config, max_reqs=1, max_len=64, dtype=dtype)
        alone.append(kv.forward(model, backend, [p], rows=[0], prefix_lens=[0], all_logits=True, invariant=True))
    kv = PagedKV(model.config, max_reqs=len(prompts), max_len=64, dtype=dtype)
    together = kv.forward(model, backend, prompts, rows=list(range(len(prompts))), prefix_lens=[0] * len(prompts),
                          all_logits=True, invariant=True)
    assert torch.equal(together, torch.cat(alone))


def test_bf16_experts_without_quantization_keep_one_copy_and_one_probe(tmp_path, monkeypatch) -> None:
    from kvserve.model import dense

    probes = []
    real = dense.lone_row_differs
    monkeypatch.setattr(dense, "lone_row_differs", lambda packed: probes.append(packed.shape) or real(packed))
    path = write_tiny_model(tmp_path / "m", family="qwen3_moe", hidden_size=64, intermediate_size=128, extra=MOE)
    f32 = load_model(str(path), dtype=torch.float32, quantization="none").model
    bf16 = load_model(str(path), dtype=torch.bfloat16, quantization="none").model
    for layer in bf16.layers:
        packed = all(lin.packed is not None for lin in layer.moe.linears())
        assert (layer.moe.gate_up_weight.numel() == 0) == packed  # freed exactly where the packed copies serve
    if any(layer.moe.linears()[0].packed is not None for layer in bf16.layers):
        # per layer q/k/v, o, the router and one per expert shape (not one per expert: 16 here); the head
        assert len(probes) == 5 * len(bf16.layers) + 1
    ids = torch.tensor([5, 17, 99, 3, 200, 41])
    attend = causal_attention(bf16.config)
    got = bf16.forward_tokens(ids, torch.arange(6), attend, torch.tensor([5]))
    want = f32.forward_tokens(ids, torch.arange(6), attend, torch.tensor([5]))
    assert ((got - want).norm() / want.norm()).item() < 0.05
