"""The native decode attention alone, as a decode step calls it: one `DecodeAttention` bound
per step, called once per layer over that layer's own caches (30 layers of the default
model's shape: 9 q heads, 3 KV heads, head_dim 64), so that the K/V come from memory as in
a step; prints the median per-call time (Python wrapper included) of several passes for
each batch, context and cache dtype, beside the CPU's vector flags.

Slots are laid out as memsvc hands them out (each prompt in one run, then chunks of 32 as
the requests grow in turn: bench/cpu_attention.py's "chunked" layout). Where 30 layers'
caches would pass --max-mib, fewer distinct caches are cycled through (each is still read
from memory: the others in between are far larger than the L3). A 64 MiB read before each
pass evicts the last pass's caches.

`--raw` calls the C function with its arguments made ahead (ctypes' cost stays, not
DecodeAttention's checks and output allocation): the kernel's share of a call.

`--ref REV` also builds csrc/decode_attention.c as of git revision REV (the same flags as
the production build, kvserve.kernels.native.FLAGS) and alternates its passes with this
tree's (ABBA), so that a noisy, shared machine slows both alike; the table then gives both
medians and their ratio.

    .venv/bin/python bench/decode_attention.py [--ref HEAD] [--passes 7] [--threads 2]
    .venv/bin/python bench/decode_attention.py --batches 1 --contexts 160 --dtypes float32
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_attention import Case, slot_table  # noqa: E402
from e2e_throughput import cpu_flags  # noqa: E402

from kvserve.kernels import native  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CSRC = "kvserve/kernels/csrc"


def build_at(rev: str, workdir: Path) -> ctypes.CDLL:
    """decode_attention.c (and the headers it includes) as of git revision `rev`, built alone with the
    production flags (plus KVSERVE_NATIVE_FLAGS, as native's own build) and loaded as
    `native.build` loads its library."""
    root = Path(__file__).resolve().parent.parent
    for name in ("decode_attention.c", "bf16.h", "scratch.h"):
        shown = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=root, capture_output=True,
                               check=name.endswith(".c"))  # a header `rev` lacks is written empty
        (workdir / name).write_bytes(shown.stdout if shown.returncode == 0 else b"")
    extra = tuple(os.environ.get("KVSERVE_NATIVE_FLAGS", "").split())
    target = workdir / "decode_attention.so"
    subprocess.run(["cc", *native.FLAGS, *extra, "-o", str(target), str(workdir / "decode_attention.c"), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(target))
    for name in ("kvs_decode_attention_f32", "kvs_decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 \
            + [ctypes.c_int64] * 5 + [ctypes.c_float]
    return lib


def time_case(libs: dict[str, ctypes.CDLL], dtype: torch.dtype, batch: int, context: int,
              args: argparse.Namespace, evict: torch.Tensor) -> dict[str, float]:
    """Median microseconds per call of each library over args.passes passes of args.layers calls."""
    gen = torch.Generator().manual_seed(batch * 10007 + context)
    hq, hkv, d = 9, 3, 64
    r2t = slot_table(Case("", batch, context - 1, 1), "chunked", 32, gen)
    size = int(r2t.max()) + 1
    layer_bytes = 2 * size * hkv * d * torch.finfo(dtype).bits // 8
    distinct = max(1, min(args.layers, args.max_mib * 2**20 // layer_bytes))
    caches = [(torch.randn(size, hkv, d, generator=gen).to(dtype), torch.randn(size, hkv, d, generator=gen).to(dtype))
              for _ in range(distinct)]
    qs = [torch.randn(batch, hq, d, generator=gen).to(dtype) for _ in range(args.layers)]
    rows = torch.arange(batch, dtype=torch.int64)
    lens = torch.full((batch,), context, dtype=torch.int64)
    out = torch.empty_like(qs[0])
    raw = [(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), r2t.data_ptr(), *r2t.shape, rows.data_ptr(),
            lens.data_ptr(), batch, hq, hkv, d, size, d**-0.5)
           for q, (k, v) in zip(qs, (caches[layer % distinct] for layer in range(args.layers)), strict=True)]
    kernel = "kvs_decode_attention_bf16" if dtype == torch.bfloat16 else "kvs_decode_attention_f32"
    times: dict[str, list[float]] = {name: [] for name in libs}
    order = list(libs)
    for p in range(args.passes):
        for name in order if p % 2 == 0 else order[::-1]:
            evict.sum()
            t0 = time.perf_counter()
            if args.raw:
                fn = getattr(libs[name], kernel)
                for call in raw:
                    fn(*call)
            else:
                bound = native.DecodeAttention(r2t, rows, lens, libs[name])
                for layer, q in enumerate(qs):
                    bound(q, *caches[layer % distinct], d**-0.5)
            times[name].append((time.perf_counter() - t0) / args.layers * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="", help="git revision of decode_attention.c to alternate with")
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch's threads (0: leave torch's default)")
    ap.add_argument("--max-mib", type=int, default=1024, help="at most this much of distinct caches")
    ap.add_argument("--raw", action="store_true",
                    help="call the C function through ctypes alone (no DecodeAttention per call), as C callers do")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.available():
        print("the native kernels did not build here", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"ref": build_at(args.ref, Path(tmp))} if args.ref else {}
        libs["this tree"] = native.build(tuple(os.environ.get("KVSERVE_NATIVE_FLAGS", "").split()))
        evict = torch.randn(16 * 2**20)
        print(f"cpu flags: {cpu_flags()}; threads {torch.get_num_threads()}; "
              f"AVX-512 BF16 path: {bool(libs['this tree'].kvs_avx512_bf16())}; median of {args.passes} passes")
        head = f"{'dtype':>9} {'batch':>5} {'context':>7}" + "".join(f" {n + ' us':>12}" for n in libs)
        print(head + (f" {'speedup':>8}" if args.ref else ""))
        for dtype_name in args.dtypes.split(","):
            for batch in map(int, args.batches.split(",")):
                for context in map(int, args.contexts.split(",")):
                    med = time_case(libs, DTYPES[dtype_name], batch, context, args, evict)
                    line = f"{dtype_name:>9} {batch:>5} {context:>7}" + "".join(f" {med[n]:>12.1f}" for n in libs)
                    if args.ref:
                        line += f" {med['ref'] / med['this tree']:>7.2f}x"
                    print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
