"""reference.py (the test oracle) against torch SDPA on dense per-request tensors."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import build_step_metadata, get_backend

from .conftest import dense_oracle, make_batch

CASES = [
    # prefix, extend, Hq, Hkv, D
    ([0, 5, 17], [7, 1, 30], 9, 3, 64),
    ([3, 70, 17, 0], [1, 1, 1, 1], 8, 1, 13),
    ([40, 0], [1, 33], 8, 8, 80),
    ([0], [1], 4, 4, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("prefix", "extend", "hq", "hkv", "d"), CASES)
def test_reference_matches_sdpa(prefix, extend, hq, hkv, d, dtype):
    b = make_batch(prefix, extend, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                   device="cpu", workspace=False)
    scale = 0.7 * d**-0.5
    expected = dense_oracle(b, scale)
    out = get_backend("reference").attention(b.q, b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache,
                                         meta=b.meta, sm_scale=scale)
    assert out.dtype == dtype and out.shape == b.q.shape
    err = (out.double() - expected).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert err <= tol, f"max abs error {err:.3g} > {tol}"
    stored = b.k_cache[b.meta.out_cache_loc]
    assert torch.equal(stored, b.k), "new K was not stored at out_cache_loc"


def test_metadata_fields():
    r2t = torch.arange(40, dtype=torch.int32).view(4, 10)
    meta = build_step_metadata(req_to_token=r2t, req_pool_indices=[2, 0], prefix_lens=[3, 0],
                         extend_lens=[2, 5], num_q_heads=2, head_dim=8, device="cpu", block_q=2)
    assert meta.qo_indptr.tolist() == [0, 2, 7]
    assert meta.kv_indptr.tolist() == [0, 5, 10]
    assert meta.seq_lens.tolist() == [5, 5]
    assert meta.positions.tolist() == [3, 4, 0, 1, 2, 3, 4]
    assert meta.out_cache_loc.tolist() == [23, 24, 0, 1, 2, 3, 4]
    assert meta.q_tile_to_batch.tolist() == [0, 1, 1, 1]
    assert meta.q_tile_to_index.tolist() == [0, 0, 1, 2]
    assert not meta.is_decode and meta.max_seq_len == 5 and meta.max_extend_len == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prefix_lens=[0], extend_lens=[1, 1]), "equal lengths"),
        (dict(prefix_lens=[0, 0], extend_lens=[1, 0]), "extend_len"),
        (dict(prefix_lens=[0, -1], extend_lens=[1, 1]), "prefix_lens"),
        (dict(prefix_lens=[0, 9], extend_lens=[1, 2]), "max_context_len"),
    ],
)
def test_metadata_rejects_bad_input(kwargs, message):
    r2t = torch.zeros(4, 10, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        build_step_metadata(req_to_token=r2t, req_pool_indices=[0, 1], num_q_heads=2, head_dim=8,
                      device="cpu", **kwargs)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("cuda-magic")
