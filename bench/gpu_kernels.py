"""GPU benchmark of the Triton attention kernels: `python bench/gpu_kernels.py`.

Decode: batch 1/16/64 x context 1k/4k/16k, 64 query heads over 8 KV heads (GQA 8), head
dim 128, bf16; reports achieved bandwidth (K/V bytes read / time) and its fraction of the
device's peak.  Extend: 8 prefills of 2k tokens with 0 and 2k cached prefix; reports
TFLOP/s beside torch SDPA on the same data laid out densely.

Without CUDA it exits with a message; `--dry-run` runs tiny shapes (in the Triton
interpreter on CPU) to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

# Peak HBM bandwidth in TB/s, matched against torch.cuda.get_device_name().
PEAK_TBPS = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0, "L40S": 0.864}


@dataclass(frozen=True, slots=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefills: int
    prefill_len: int
    prefixes: tuple[int, ...]


FULL = Shape(64, 8, 128, (1, 16, 64), (1024, 4096, 16384), 8, 2048, (0, 2048))
TINY = Shape(8, 1, 16, (1, 2), (40, 100), 2, 24, (0, 16))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, Triton interpreter when there is no GPU")
    parser.add_argument("--peak-tbps", type=float, default=None,
                        help="device peak memory bandwidth in TB/s (default: by device name)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per case")
    return parser.parse_args(argv)


def peak_bandwidth(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps
    return None


def timed(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Mean seconds per call after two warm-up calls."""
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def make_pool(seq_lens: list[int], shape: Shape, dtype: torch.dtype, device: str):
    """Caches plus a req_to_token table giving each request a contiguous run of slots."""
    size = sum(seq_lens) + 1
    r2t = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32, device=device)
    off = 1
    for i, n in enumerate(seq_lens):
        r2t[i, :n] = torch.arange(off, off + n, dtype=torch.int32, device=device)
        off += n
    kv = (size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(kv, dtype=dtype, device=device)
    v_cache = torch.randn(kv, dtype=dtype, device=device)
    return r2t, k_cache, v_cache


def bench_decode(shape: Shape, dtype, device, iters, peak) -> list[list[str]]:
    from kvserve.kernels import DecodeWorkspace, build_step_metadata
    from kvserve.kernels.decode import decode_attention

    rows = []
    for bsz in shape.batches:
        ws = DecodeWorkspace.create(max_batch=bsz, num_q_heads=shape.num_q_heads,
                                    head_dim=shape.head_dim, dtype=dtype, device=device)
        for ctx in shape.contexts:
            r2t, kc, vc = make_pool([ctx] * bsz, shape, dtype, device)
            meta = build_step_metadata(req_to_token=r2t, req_pool_indices=list(range(bsz)),
                                 prefix_lens=[ctx - 1] * bsz, extend_lens=[1] * bsz,
                                 num_q_heads=shape.num_q_heads, head_dim=shape.head_dim,
                                 device=device, workspace=ws, num_kv_heads=shape.num_kv_heads)
            q = torch.randn(bsz, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
            scale = shape.head_dim**-0.5
            call = partial(decode_attention, q, k_cache=kc, v_cache=vc, meta=meta, sm_scale=scale)
            sec = timed(call, iters, device == "cuda")
            nbytes = 2 * bsz * ctx * shape.num_kv_heads * shape.head_dim * kc.element_size()
            tbps = nbytes / sec / 1e12
            frac = f"{100 * tbps / peak:.0f}%" if peak else "n/a"
            rows.append([str(bsz), str(ctx), str(meta.num_kv_splits), f"{sec * 1e6:.1f}",
                         f"{tbps:.3f}", frac])
    return rows


def bench_extend(shape: Shape, dtype, device, iters) -> list[list[str]]:
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from kvserve.kernels import build_step_metadata
    from kvserve.kernels.extend import extend_attention

    rows = []
    n, e, hq, hkv, d = (shape.prefills, shape.prefill_len, shape.num_q_heads,
                        shape.num_kv_heads, shape.head_dim)
    for prefix in shape.prefixes:
        seq = prefix + e
        r2t, kc, vc = make_pool([seq] * n, shape, dtype, device)
        meta = build_step_metadata(req_to_token=r2t, req_pool_indices=list(range(n)),
                             prefix_lens=[prefix] * n, extend_lens=[e] * n, num_q_heads=hq,
                             head_dim=d, device=device, num_kv_heads=hkv)
        q = torch.randn(n * e, hq, d, dtype=dtype, device=device)
        scale = d**-0.5
        out = extend_attention(q, k_cache=kc, v_cache=vc, meta=meta, sm_scale=scale)
        call = partial(extend_attention, q, k_cache=kc, v_cache=vc, meta=meta, sm_scale=scale,
                       out=out)
        sec = timed(call, iters, device == "cuda")
        # Dense copy of the same data for SDPA (slots are contiguous per request).
        kd = kc[1:].view(n, seq, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        vd = vc[1:].view(n, seq, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        qd = q.view(n, e, hq, d).transpose(1, 2)
        mask = causal_lower_right(e, seq)
        sdpa = partial(F.scaled_dot_product_attention, qd, kd, vd, attn_mask=mask, scale=scale)
        sdpa_sec = timed(sdpa, iters, device == "cuda")
        err = (sdpa().transpose(1, 2).reshape_as(out).float() - out.float()).abs().max().item()
        visible = n * (e * prefix + e * (e + 1) // 2)  # (query, key) pairs attended
        flops = 4 * hq * d * visible
        rows.append([f"{n}x{e}", str(prefix), f"{sec * 1e3:.2f}", f"{flops / sec / 1e12:.1f}",
                     f"{sdpa_sec * 1e3:.2f}", f"{flops / sdpa_sec / 1e12:.1f}", f"{err:.2e}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_kernels: no CUDA device; this benchmark needs a GPU "
              "(use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    peak = peak_bandwidth(name, args.peak_tbps)
    shape = TINY if args.dry_run else FULL
    dtype = torch.bfloat16
    iters = 1 if not cuda else args.iters
    torch.manual_seed(0)
    print(f"device: {name}; peak bandwidth: {f'{peak} TB/s' if peak else 'unknown (--peak-tbps)'}")
    print(f"heads {shape.num_q_heads}q/{shape.num_kv_heads}kv, head dim {shape.head_dim}, bf16\n")
    print("decode (split-KV)")
    print(format_table(["batch", "context", "splits", "us", "TB/s", "of peak"],
                       bench_decode(shape, dtype, device, iters, peak)))
    print("\nextend (prefill, causal + cached prefix)")
    print(format_table(["prefills", "prefix", "triton ms", "TFLOP/s", "sdpa ms", "sdpa TFLOP/s",
                        "max |diff|"], bench_extend(shape, dtype, device, iters)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
