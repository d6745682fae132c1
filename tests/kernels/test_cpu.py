"""cpu.py (the fast "torch" backend) against float64 SDPA on dense per-request tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvserve.kernels import cpu, get_backend

from .conftest import dense_oracle, make_batch

CASES = [
    # prefix, extend, Hq, Hkv, D
    ([0, 5, 17], [7, 1, 30], 9, 3, 64),  # mixed: fresh prompt, decode, chunk after prefix
    ([3, 70, 17, 0], [1, 1, 1, 1], 8, 1, 13),  # ragged decode, group 8
    ([12, 12, 12], [1, 1, 1], 9, 3, 64),  # equal-length decode (no mask)
    ([40, 0], [1, 33], 8, 8, 64),  # group 1
    ([0, 0], [20, 9], 3, 1, 13),  # two fresh prompts
    ([25], [6], 9, 3, 13),  # one chunk after a prefix
    ([0], [1], 4, 4, 16),
]


@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("prefix", "extend", "hq", "hkv", "d"), CASES)
def test_cpu_matches_sdpa(prefix, extend, hq, hkv, d, dtype, contiguous):
    b = make_batch(prefix, extend, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                   device="cpu", workspace=False, contiguous=contiguous, seed=sum(prefix) + d)
    scale = 0.7 * d**-0.5
    expected = dense_oracle(b, scale)
    out = cpu.attention(b.q, b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                        sm_scale=scale)
    assert out.dtype == dtype and out.shape == b.q.shape
    err = (out.double() - expected).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert err <= tol, f"max abs error {err:.3g} > {tol}"
    assert torch.equal(b.k_cache[b.meta.out_cache_loc], b.k), "new K not stored at out_cache_loc"
    assert torch.equal(b.v_cache[b.meta.out_cache_loc], b.v), "new V not stored at out_cache_loc"


def test_layers_reuse_plan_without_stale_data():
    """Two layers with different caches share one meta (and its gather buffers)."""
    b1 = make_batch([9, 30, 4], [1, 1, 1], num_q_heads=6, num_kv_heads=2, head_dim=16,
                    dtype=torch.float32, device="cpu", workspace=False, seed=1)
    b2 = replace(b1, **{f: torch.randn_like(getattr(b1, f)) for f in ("q", "k", "v")},
                 k_cache=torch.randn_like(b1.k_cache), v_cache=torch.randn_like(b1.v_cache))
    meta = b1.meta
    for b in (b1, b2, b1):
        out = cpu.attention(b.q, b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, meta=meta,
                            sm_scale=0.25)
        assert (out.double() - dense_oracle(b, 0.25)).abs().max().item() <= 1e-5
    assert "cpu" in meta.backend_cache


def test_padding_never_reads_unrelated_slots():
    """Short decode requests are padded; NaN in unused slots must not leak into outputs."""
    b = make_batch([2, 50], [1, 1], num_q_heads=4, num_kv_heads=2, head_dim=16,
                   dtype=torch.float32, device="cpu", workspace=False)
    used = torch.zeros(b.k_cache.shape[0], dtype=torch.bool)
    for row, n in zip(b.rows, [3, 51], strict=True):
        used[b.req_to_token[row, :n].long()] = True
    b.k_cache[~used] = float("nan")
    b.v_cache[~used] = float("nan")
    out = cpu.attention(b.q, b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                        sm_scale=0.25)
    assert torch.isfinite(out).all()
    assert (out.double() - dense_oracle(b, 0.25)).abs().max().item() <= 1e-5


def test_torch_backend_is_cpu_and_checks_shapes():
    assert get_backend("torch") is cpu
    b = make_batch([3], [2], num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                   device="cpu", workspace=False)
    with pytest.raises(ValueError, match="tokens"):
        cpu.attention(b.q[:1], b.k[:1], b.v[:1], k_cache=b.k_cache, v_cache=b.v_cache,
                      meta=b.meta, sm_scale=0.25)
    with pytest.raises(ValueError, match="kv heads"):
        cpu.attention(b.q[:, :3], b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                      sm_scale=0.25)


@pytest.mark.parametrize(("prefix", "contiguous", "views"), [
    ([60], True, True), ([60], False, False), ([60, 8], True, False),
])
def test_decode_path_choice(prefix, contiguous, views, monkeypatch):
    """Without the native kernel, a lone one-run decode request reads views; batches and
    scattered slots are gathered."""
    monkeypatch.setattr(cpu.native, "supports", lambda q, k_cache: False)
    b = make_batch(prefix, [1] * len(prefix), num_q_heads=6, num_kv_heads=2, head_dim=16,
                   dtype=torch.float32, device="cpu", workspace=False, contiguous=contiguous)
    out = cpu.attention(b.q, b.k, b.v, k_cache=b.k_cache, v_cache=b.v_cache, meta=b.meta,
                        sm_scale=0.25)
    assert (b.meta.backend_cache["cpu"].gather.runs is not None) == views
    assert (out.double() - dense_oracle(b, 0.25)).abs().max().item() <= 1e-5
