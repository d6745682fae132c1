"""kvserve.kernels.native: the C decode attention, in place over the pool, against float64
attention on the gathered K/V, and the RMS norm against torch's ops (both builds: this
CPU's, and the portable one without AVX-512, which is the AVX2 one on an AVX2 CPU; the
decode attention also in a build without AVX2, its plain C path)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvserve.kernels import native
from kvserve.kernels.native import loader

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request):
    built = native.build() if request.param == "native" else native.build(("-mno-avx512f",))
    assert built is not None, "the kernels did not build with the system compiler"
    if request.param == "portable":
        assert built.kvs_avx512_bf16() == 0
    return built


def oracle(q, k_cache, v_cache, r2t, rows, lens, scale):
    out = []
    hq, hkv = q.shape[1], k_cache.shape[1]
    for b in range(q.shape[0]):
        slots = r2t[rows[b], : lens[b]].long()
        k = k_cache[slots].double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = v_cache[slots].double().repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[b].double() * scale, k), dim=-1)
        out.append(torch.einsum("hl,lhd->hd", w, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d", "lens"), [
    (9, 3, 64, [1, 31, 32, 33, 200]),  # the default model's heads; block edges
    (8, 1, 128, [70, 5]),  # group 8, D 128
    (4, 4, 48, [65, 17, 1]),  # group 1, a D without a fixed-length loop
])
def test_matches_attention_on_gathered_kv(lib, dtype, hq, hkv, d, lens):
    g = torch.Generator().manual_seed(d + len(lens))
    size = 1024
    k_cache = torch.randn(size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(size, hkv, d, generator=g).to(dtype)
    r2t = torch.full((8, 512), -1, dtype=torch.int32)
    rows = torch.tensor([5, 0, 7, 2, 3][: len(lens)], dtype=torch.int64)
    for row, n in zip(rows.tolist(), lens, strict=True):
        r2t[row, :n] = torch.randperm(size, generator=g)[:n].int()  # scattered slots
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    out = native.decode_attention(q, k_cache, v_cache, r2t, rows, lens_t, d**-0.5, lib=lib)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double() - oracle(q, k_cache, v_cache, r2t, rows, lens, d**-0.5)).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


def test_a_step_binding_serves_every_layer_as_the_plain_call(lib):
    """DecodeAttention checks a step's rows and lengths once; each layer's call equals
    decode_attention on that layer's caches, and a q of another batch is refused."""
    g = torch.Generator().manual_seed(11)
    layers = [(torch.randn(256, 3, 64, generator=g).bfloat16(), torch.randn(256, 3, 64, generator=g).bfloat16())
              for _ in range(2)]
    r2t = torch.randperm(256, generator=g)[:240].int().reshape(3, 80)
    rows, lens = torch.tensor([2, 0]), torch.tensor([80, 17])
    bound = native.DecodeAttention(r2t, rows, lens, lib)
    for k_cache, v_cache in layers:
        q = torch.randn(2, 9, 64, generator=g).bfloat16()
        assert torch.equal(bound(q, k_cache, v_cache, 0.125),
                           native.decode_attention(q, k_cache, v_cache, r2t, rows, lens, 0.125, lib=lib))
    with pytest.raises(ValueError, match=r"contiguous caches, int32 req_to_token, int64 rows/lens, q \[2, Hq, D\]"):
        bound(torch.zeros(3, 9, 64, dtype=torch.bfloat16), *layers[0], 0.125)
    with pytest.raises(ValueError, match="int32 req_to_token"):
        native.DecodeAttention(r2t.long(), rows, lens, lib)


def test_slot_outside_the_pool_is_refused(lib):
    k_cache = torch.zeros(64, 3, 64, dtype=torch.bfloat16)
    r2t = torch.zeros(4, 128, dtype=torch.int32)
    r2t[1, :40] = torch.arange(40, dtype=torch.int32)
    r2t[1, 37] = 64  # one past the pool
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="batch row 1 has a slot outside the pool of 64"):
        native.decode_attention(q, k_cache, k_cache, r2t, torch.tensor([0, 1]), torch.tensor([3, 40]),
                                0.125, lib=lib)


@pytest.fixture(scope="module")
def plain_lib():
    """A build without AVX2 (nor AVX-512): the decode attention's plain C path for every D."""
    built = native.build(("-mno-avx512f", "-mno-avx2"))
    assert built is not None, "the kernels did not build without AVX2"
    return built


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's (and so the kernels') OpenMP threads set to n for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_case(dtype, hq, hkv, d, lens, seed):
    """(q, k_cache, v_cache, req_to_token, rows, lens) with scattered slots, rows in a
    shuffled order, and NaN K/V in every slot no row names (never to be read)."""
    g = torch.Generator().manual_seed(seed)
    size = sum(lens) + 64
    k_cache = torch.randn(size, hkv, d, generator=g)
    v_cache = torch.randn(size, hkv, d, generator=g)
    r2t = torch.full((len(lens) + 2, max(lens) + 3), -1, dtype=torch.int32)
    rows = torch.randperm(len(lens) + 2, generator=g)[: len(lens)]
    slots = torch.randperm(size, generator=g)
    used = torch.zeros(size, dtype=torch.bool)
    start = 0
    for row, n in zip(rows.tolist(), lens, strict=True):
        r2t[row, :n] = slots[start : start + n].int()
        used[slots[start : start + n]] = True
        start += n
    k_cache[~used] = float("nan")
    v_cache[~used] = float("nan")
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, k_cache.to(dtype), v_cache.to(dtype), r2t, rows, torch.tensor(lens)


LONG_CASES = [
    (9, 3, 64, [2047]),  # one long request: its chunks spread over the threads
    (9, 3, 64, [1000, 33]),  # two, ragged, neither length a multiple of a chunk
    (8, 1, 128, [1537]),  # group 8, D 128
    (32, 8, 128, [700, 2]),  # 8 KV heads: two items of 4 per row
    (20, 20, 64, [129, 64]),  # group 1, 20 KV heads: items of 16 and 4
    (4, 4, 48, [999]),  # a D without a fixed-length loop
]


def check_long(lib, dtype, hq, hkv, d, lens):
    q, k_cache, v_cache, r2t, rows, lens_t = random_case(dtype, hq, hkv, d, lens, seed=d + sum(lens))
    scale = 1.5 * d**-0.5  # peakier weights than 1/sqrt(d)
    for n in (1, 4):  # one thread: each row whole; four: chunks spread
        with threads(n):
            out = native.decode_attention(q, k_cache, v_cache, r2t, rows, lens_t, scale, lib=lib)
        assert out.dtype == dtype and out.shape == q.shape
        err = (out.double() - oracle(q, k_cache, v_cache, r2t, rows, lens, scale)).abs().max().item()
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2
        assert err <= tol, f"{n} thread(s): max abs error {err:.3g} > {tol}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d", "lens"), LONG_CASES)
def test_long_contexts_match_attention_on_gathered_kv(lib, dtype, hq, hkv, d, lens):
    check_long(lib, dtype, hq, hkv, d, lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d", "lens"), LONG_CASES[1:3] + [(9, 3, 64, [1, 31, 32, 33, 200])])
def test_the_plain_path_matches_attention_on_gathered_kv(plain_lib, dtype, hq, hkv, d, lens):
    check_long(plain_lib, dtype, hq, hkv, d, lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_alone_in_any_batch_on_any_threads(lib, dtype):
    """Chunks are fixed by the length alone and merged in their order, so a row's result is
    the same bits whether one thread runs all its chunks (one thread; the 16 rows on 2) or
    several share them (a few rows alone; the 16 on 5 threads)."""
    lens = [1500, 70, 2000, 1, 300, 31, 64, 65, 257, 256, 33, 129, 2, 511, 100, 40]
    q, k_cache, v_cache, r2t, rows, lens_t = random_case(dtype, 9, 3, 64, lens, seed=5)

    def attend(pick: list[int]) -> torch.Tensor:
        return native.decode_attention(q[pick], k_cache, v_cache, r2t, rows[pick], lens_t[pick], 0.125, lib=lib)

    everyone = list(range(len(lens)))
    with threads(1):
        whole = attend(everyone)
    assert torch.isfinite(whole).all()
    for n in (1, 2, 5):
        with threads(n):
            for pick in [everyone, [0, 2], *([b] for b in everyone)]:
                assert torch.equal(attend(pick), whole[pick]), f"rows {pick} on {n} threads"


@pytest.mark.parametrize("n", [1, 4])
def test_a_slot_outside_the_pool_in_a_late_chunk_names_the_first_such_row(lib, n):
    q, k_cache, v_cache, r2t, rows, lens = random_case(torch.float32, 9, 3, 64, [40, 900, 700], seed=3)
    r2t[rows[1], 850] = k_cache.shape[0]  # one past the pool, in a late chunk
    r2t[rows[2], 650] = -1
    with threads(n), pytest.raises(ValueError, match="batch row 1 has a slot outside the pool"):
        native.decode_attention(q, k_cache, v_cache, r2t, rows, lens, 0.125, lib=lib)
    with threads(n), pytest.raises(ValueError, match="batch row 0 has a slot outside the pool"):
        native.decode_attention(q[2:], k_cache, v_cache, r2t, rows[2:], lens[2:], 0.125, lib=lib)


def test_the_cpu_backend_takes_it_for_decode():
    """Where it builds, the production CPU backend's decode reads the pool in place."""
    assert native.available()
    q = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    assert native.supports(q, torch.zeros(4, 3, 64, dtype=torch.bfloat16))
    assert not native.supports(q, torch.zeros(4, 3, 64, dtype=torch.float16))


@pytest.mark.parametrize(("rows", "lens", "what"), [
    ([0, 4], [3, 3], "batch row 1 names row 4 or length 3"),
    ([0, 1], [3, 129], "batch row 1 names row 1 or length 129"),
    ([0, 1], [0, 3], "batch row 0 names row 0 or length 0"),
])
def test_rows_and_lengths_outside_req_to_token_are_refused(lib, rows, lens, what):
    k_cache = torch.zeros(64, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=what):
        native.decode_attention(q, k_cache, k_cache, torch.zeros(4, 128, dtype=torch.int32),
                                torch.tensor(rows), torch.tensor(lens), 0.125, lib=lib)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 33, 300])
def test_rms_norm_rounds_as_torch(lib, dtype, rows, monkeypatch):
    monkeypatch.setattr(loader, "_load", lambda: lib)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = native.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    # the float32 sum's order may differ: in bfloat16 at most one unit in the last place,
    # rarely; in float32 a few (the 1/rms, the product and the weight's product each round)
    ulps = 1 if dtype == torch.bfloat16 else 4
    bound = ulps * torch.finfo(dtype).eps * expected.float().abs().clamp_min(1e-30)
    assert ((out.float() - expected.float()).abs() <= bound).all()
    if dtype == torch.bfloat16:
        assert (out != expected).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_argmax_is_torchs_first_index_and_flags_the_nonfinite_rows(lib, dtype, monkeypatch):
    monkeypatch.setattr(loader, "_load", lambda: lib)
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(12, 1100, generator=g).to(dtype)  # 1,000 columns used: not whole blocks of 256
    x = wide[:, :1000]  # rows strided as a view of a wider tensor
    x[1, [40, 41]] = 9.0  # a tie inside one block of 256
    x[2, [300, 20]] = 9.0  # a tie across blocks: the first is in the earlier block
    x[3, [255, 256]] = 9.0  # a tie across a block boundary
    x[4, 999] = 9.0  # the last column, in a short last block
    x[5, 0] = 9.0
    x[6] = -3.0  # all equal: column 0
    x[7, 500] = float("nan")
    x[8, 3] = float("inf")
    x[9, 998] = float("-inf")
    x[10, 10], x[10, 700] = -float("inf"), float("nan")
    index, finite = native.row_argmax(x)
    expect_finite = torch.isfinite(x.float()).all(-1)
    assert finite.tolist() == expect_finite.tolist() == [True] * 7 + [False] * 4 + [True]
    assert torch.equal(index[expect_finite], x.float().argmax(-1)[expect_finite])
    assert index[:7].tolist() == [int(x[0].float().argmax()), 40, 20, 255, 999, 0, 0]
    assert index[~expect_finite].tolist() == [0, 0, 0, 0]


def test_row_argmax_declines_what_it_does_not_take():
    assert native.row_argmax(torch.zeros(4, dtype=torch.float32)) is None  # not [B, V]
    assert native.row_argmax(torch.zeros(2, 4, dtype=torch.float16)) is None
    assert native.row_argmax(torch.zeros(4, 2).t()) is None  # values of a row not contiguous
    assert native.row_argmax(torch.zeros(2, 0)) is None


def test_rms_norm_refuses_a_weight_of_another_shape():
    x = torch.zeros(2, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight must be contiguous \[576\] torch.bfloat16"):
        native.rms_norm(x, torch.ones(575, dtype=torch.bfloat16), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_gives_the_torch_ops_numbers_bit_for_bit(lib, dtype, monkeypatch):
    from kvserve.model.blocks import apply_rotary

    monkeypatch.setattr(loader, "_load", lambda: lib)
    g = torch.Generator().manual_seed(7)
    d, heads, tokens = 64, 12, 40
    qkv = (torch.randn(tokens, 15 * d, generator=g) * 2).to(dtype)  # q+k heads, then v
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(300).float()[:, None] * inv_freq[None, :]
    cos_t, sin_t = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 300, (tokens,), generator=g)
    out = native.rotary(qkv[:, : heads * d], heads, cos_t, sin_t, positions)
    cos = cos_t[positions].to(dtype).unsqueeze(1)
    sin = sin_t[positions].to(dtype).unsqueeze(1)
    expected = apply_rotary(qkv[:, : heads * d].view(tokens, heads, d), cos, sin)
    assert out.dtype == dtype and out.shape == (tokens, heads, d)
    assert torch.equal(out, expected)


def test_rotary_refuses_a_position_outside_the_tables():
    tab = torch.zeros(10, 32)
    x = torch.zeros(3, 2 * 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="position 10 of token 2 is outside the tables of 10"):
        native.rotary(x, 2, tab, tab, torch.tensor([0, 9, 10]))


def test_store_rows_puts_strided_rows_at_their_slots(lib, monkeypatch):
    monkeypatch.setattr(loader, "_load", lambda: lib)
    qkv = torch.arange(5 * 15 * 8, dtype=torch.float32).view(5, 15 * 8).bfloat16()
    v = qkv[:, 12 * 8 :].view(5, 3, 8)  # strided between tokens, each token's row contiguous
    cache = torch.zeros(20, 3, 8, dtype=torch.bfloat16)
    loc = torch.tensor([19, 0, 7, 8, 3])
    native.store_rows(v, cache, loc)
    expected = torch.zeros_like(cache)
    expected.index_copy_(0, loc, v)
    assert torch.equal(cache, expected)


def test_store_rows_refuses_a_slot_outside_the_cache_and_writes_nothing(lib, monkeypatch):
    monkeypatch.setattr(loader, "_load", lambda: lib)
    cache = torch.zeros(20, 3, 8)
    with pytest.raises(ValueError, match="slot 20 of token 2 is outside the cache of 20"):
        native.store_rows(torch.ones(3, 3, 8), cache, torch.tensor([0, 1, 20]))
    assert not cache.any()


def test_a_model_with_the_native_row_ops_gives_its_torch_logits(tmp_path):
    """use_row_ops(native): the RMS norms and the rotary go through the kernels (counted),
    and the logits stay those of torch's ops (bf16: a rare last-place difference in a norm)."""
    from kvserve.model.weights import load_model
    from tests.model.tinymodel import write_tiny_model

    model = load_model(str(write_tiny_model(tmp_path / "tiny")), dtype=torch.bfloat16).model
    calls = {"rms_norm": 0, "rotary": 0}

    class Counted:
        rowwise = staticmethod(native.rowwise)

        def rms_norm(self, *a):
            calls["rms_norm"] += 1
            return native.rms_norm(*a)

        def rotary(self, *a):
            calls["rotary"] += 1
            return native.rotary(*a)

    def attend(_, q, k, v):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)

    ids = torch.arange(3, 40)
    run = lambda: model.forward_tokens(ids, torch.arange(len(ids)), attend, torch.arange(len(ids)))  # noqa: E731
    plain = run()
    model.use_row_ops(Counted())
    fast = run()
    layers = len(model.layers)
    assert calls == {"rms_norm": 2 * layers + 1, "rotary": layers}
    # equal here; a norm's rare last-place difference may move a logit slightly elsewhere
    assert (fast - plain).abs().max().item() <= 0.02 * plain.abs().max().item()
    assert (fast.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.97
