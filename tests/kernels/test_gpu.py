"""Compiled Triton kernels against reference.py at realistic sizes (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import get_backend

from .conftest import make_batch, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 4, 128), (9, 3, 64), (24, 8, 96), (8, 8, 80)])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_compiled_matches_reference(mode, hq, hkv, d, dtype):
    gen = torch.Generator().manual_seed(hq + d)
    bsz = 16 if mode == "decode" else 4
    prefix = torch.randint(0, 3000, (bsz,), generator=gen).tolist()
    extend = [1] * bsz if mode == "decode" else torch.randint(1, 700, (bsz,), generator=gen).tolist()
    b = make_batch(prefix, extend, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                   seed=d, device="cuda")
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    scale = d**-0.5
    out = get_backend("triton").attention(b.q, b.k, b.v, k_cache=kc, v_cache=vc, meta=b.meta,
                                          sm_scale=scale)
    expected = get_backend("reference").attention(b.q, b.k, b.v, k_cache=b.k_cache,
                                              v_cache=b.v_cache, meta=b.meta, sm_scale=scale)
    assert torch.equal(kc, b.k_cache), "store_kv wrote different slots than the reference"
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= tolerance(dtype), f"max abs error {err:.3g} ({mode}, {dtype}, splits={b.meta.num_kv_splits})"
