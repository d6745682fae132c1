"""Every Triton kernel against reference.py on small shapes.

Runs under the Triton interpreter without CUDA (see conftest.py), compiled with it.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import get_backend
from kvserve.kernels import reference as ref
from kvserve.kernels.decode import decode_attention
from kvserve.kernels.extend import extend_attention
from kvserve.kernels.store_kv import store_kv

from .conftest import make_batch, tolerance

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hkv", "d"), [(3, 13), (1, 80)])
def test_store_kv(dtype, hkv, d):
    b = make_batch([2, 0], [3, 4], num_q_heads=hkv, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    store_kv(b.k, b.v, k_cache=kc, v_cache=vc, out_cache_loc=b.meta.out_cache_loc)
    ref.store_kv(b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, out_cache_loc=b.meta.out_cache_loc)
    assert torch.equal(kc, b.k_cache) and torch.equal(vc, b.v_cache)


DECODE_CASES = [
    # prefix lens (extend = 1), Hq, Hkv, D, splits
    ([5, 70, 17], 3, 1, 13, 1),
    ([5, 70, 17], 9, 3, 64, 4),
    ([130, 2], 8, 1, 80, 8),  # split longer than one block; empty splits for the short one
    ([40], 8, 8, 64, 3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("prefix", "hq", "hkv", "d", "splits"), DECODE_CASES)
def test_decode_matches_reference(prefix, hq, hkv, d, splits, dtype):
    b = make_batch(prefix, [1] * len(prefix), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                   dtype=dtype, seed=len(prefix) + d)
    scale = 0.9 * d**-0.5
    out = decode_attention(b.q, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                           sm_scale=scale, num_kv_splits=splits)
    expected = ref.decode_attention(b.q, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                                    sm_scale=scale)
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= tolerance(dtype), f"max abs error {err:.3g} ({dtype}, splits={splits})"


EXTEND_CASES = [
    # prefix, extend, Hq, Hkv, D
    ([0, 5, 17], [7, 1, 30], 3, 1, 13),
    ([0, 0], [20, 3], 9, 3, 64),
    ([24, 3], [18, 2], 8, 1, 80),
    ([10], [5], 8, 8, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("prefix", "extend", "hq", "hkv", "d"), EXTEND_CASES)
def test_extend_matches_reference(prefix, extend, hq, hkv, d, dtype):
    b = make_batch(prefix, extend, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                   seed=sum(extend), block_q=16)
    ref.store_kv(b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, out_cache_loc=b.meta.out_cache_loc)
    scale = d**-0.5
    out = extend_attention(b.q, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta, sm_scale=scale)
    expected = ref.extend_attention(b.q, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                                    sm_scale=scale)
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= tolerance(dtype), f"max abs error {err:.3g} ({dtype})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("prefix", "extend"), [([3, 9], [1, 1]), ([0, 6], [5, 1])])
def test_backend_attention_matches_reference(prefix, extend, dtype):
    b = make_batch(prefix, extend, num_q_heads=6, num_kv_heads=2, head_dim=16,
                   dtype=dtype, block_q=16)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = get_backend("triton").attention(b.q, b.k, b.v, k_cache=kc, v_cache=vc, meta=b.meta,
                                          sm_scale=0.25)
    expected = ref.attention(b.q, b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                             sm_scale=0.25)
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= tolerance(dtype), f"max abs error {err:.3g} ({dtype})"
    assert torch.equal(kc, b.k_cache)


def test_launcher_rejects_bad_shapes():
    b = make_batch([3], [1], num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="v_cache must be"):
        decode_attention(b.q, k_cache=b.k_cache[:, :1], v_cache=b.v_cache, meta=b.meta,
                         sm_scale=0.25)
    with pytest.raises(ValueError, match="kv heads"):
        extend_attention(b.q[:, :3], k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                         sm_scale=0.25)
    wide = torch.zeros(b.req_to_token.shape[0], 2 * b.req_to_token.shape[1], dtype=torch.int32)
    b.meta.req_to_token = wide[:, ::2]  # a strided view: the kernels assume unit stride
    with pytest.raises(ValueError, match="req_to_token must be 1-D or 2-D with unit stride"):
        decode_attention(b.q, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta, sm_scale=0.25)
    b.meta.req_to_token = b.req_to_token.float()
    with pytest.raises(ValueError, match="req_to_token must be int32 or int64"):
        extend_attention(b.q, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta, sm_scale=0.25)
    with pytest.raises(ValueError, match="out_cache_loc must be int32 or int64"):
        store_kv(b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache,
                 out_cache_loc=b.meta.out_cache_loc.float())
