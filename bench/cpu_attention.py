"""Per-layer CPU attention time: kvserve backends vs SDPA on a contiguous cache.

For each case (decode at batch B and context L, or one prefill of E tokens) and dtype it
times one layer's `attention(...)` of the "torch" backend (kvserve/kernels/cpu.py) and
the "reference" oracle over a token-level pool, against the bare-loop baseline: store the
new K/V into a preallocated contiguous [B, Hkv, Lmax, D] cache and call
`F.scaled_dot_product_attention(..., enable_gqa=True)` on the filled part (`sdpa`), and
for decode the same without `enable_gqa`, each KV group's q heads as its query rows
(`sdpa_grp`, the fastest contiguous decode found; bf16 `enable_gqa` is slow).  `build`
is the per-step `build_step_metadata` time (paid once per step, not per layer).

Variants run interleaved, round after round, over `--layers` distinct caches (so the
cache is cold as in a real forward); the minimum per-layer time is reported, which keeps
ratios meaningful on a busy machine.  Model shape defaults to SmolLM2-135M (9 q heads,
3 kv heads, head_dim 64).

    .venv/bin/python bench/cpu_attention.py [--threads 2] [--rounds 15] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels import build_step_metadata, get_backend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Case:
    """One measurement: `batch` requests with `prefix` cached tokens and `extend` new ones."""

    name: str
    batch: int
    prefix: int
    extend: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=4, help="distinct per-layer caches")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--lens", default="128,256,384", help="decode context lengths")
    p.add_argument("--prefill", default="128,512", help="prefill lengths")
    p.add_argument("--layout", choices=["chunked", "contiguous", "scattered"], default="chunked",
                   help="slots of a request: prompt run + grow chunks of --chunk, one run, random")
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: process CPU time (robust to a busy machine; use with --threads 1)")
    p.add_argument("--quick", action="store_true", help="small sizes, 2 rounds (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.lens, args.prefill, args.rounds, args.layers = "2", "16", "8", 2, 1
    return args


def cases(args: argparse.Namespace) -> list[Case]:
    out = [
        Case(f"decode B={b} L={n}", b, n - 1, 1)
        for b in map(int, args.batches.split(","))
        for n in map(int, args.lens.split(","))
    ]
    out += [Case(f"prefill E={e}", 1, 0, e) for e in map(int, args.prefill.split(","))]
    return out


def slot_table(case: Case, layout: str, chunk: int, gen: torch.Generator) -> torch.Tensor:
    """[B, seq] int32 slots, laid out like memsvc's allocator would for `layout`."""
    b, seq = case.batch, case.prefix + case.extend
    size = b * seq
    if layout == "scattered":
        return (torch.randperm(size, generator=gen) + 1).view(b, seq).to(torch.int32)
    if layout == "contiguous":
        return (torch.arange(size) + 1).view(b, seq).to(torch.int32)
    prompt = min(seq, 128)
    table = torch.empty(b, seq, dtype=torch.int64)
    table[:, :prompt] = torch.arange(b * prompt).view(b, prompt) + 1
    nxt = b * prompt + 1
    for start in range(prompt, seq, chunk):
        n = min(chunk, seq - start)
        for r in range(b):  # requests grow in turn, so their chunks interleave
            table[r, start : start + n] = torch.arange(nxt, nxt + n)
            nxt += n
    return table.to(torch.int32)


def run_case(
    case: Case, dtype: torch.dtype, args: argparse.Namespace, clock: Callable[[], float]
) -> dict[str, float]:
    """Minimum per-layer milliseconds of each variant (and of build_step_metadata)."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    b, seq, e = case.batch, case.prefix + case.extend, case.extend
    table = slot_table(case, args.layout, args.chunk, gen)
    r2t = torch.zeros(b, seq + 8, dtype=torch.int32)
    r2t[:, :seq] = table
    size = int(table.max()) + 1

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    pools = [(rnd(size, hkv, d), rnd(size, hkv, d)) for _ in range(args.layers)]
    dense = [(rnd(b, hkv, seq + 8, d), rnd(b, hkv, seq + 8, d)) for _ in range(args.layers)]
    q, k, v = rnd(b * e, hq, d), rnd(b * e, hkv, d), rnd(b * e, hkv, d)
    scale = d**-0.5

    def build() -> object:
        return build_step_metadata(req_to_token=r2t, req_pool_indices=list(range(b)),
                             prefix_lens=[case.prefix] * b, extend_lens=[e] * b,
                             num_q_heads=hq, head_dim=d, device="cpu", num_kv_heads=hkv)

    def backend(name: str) -> Callable[[], float]:
        module = get_backend(name)

        def go() -> float:
            meta = build()  # untimed: the build column; a backend's own per-step plan counts
            t0 = clock()
            for kc, vc in pools:
                module.attention(q, k, v, k_cache=kc, v_cache=vc, meta=meta, sm_scale=scale)
            return clock() - t0

        return go

    qd = q.view(b, e, hq, d).transpose(1, 2)
    kd, vd = k.view(b, e, hkv, d).transpose(1, 2), v.view(b, e, hkv, d).transpose(1, 2)

    def contiguous() -> float:
        t0 = clock()
        for kc, vc in dense:
            kc[:, :, case.prefix : seq] = kd
            vc[:, :, case.prefix : seq] = vd
            F.scaled_dot_product_attention(qd, kc[:, :, :seq], vc[:, :, :seq], scale=scale,
                                           is_causal=e > 1, enable_gqa=True)
        return clock() - t0

    def grouped() -> float:
        """Decode only: the q heads of a KV group as its query rows (no GQA repeat)."""
        t0 = clock()
        qg = q.view(b, hkv, hq // hkv, d)
        for kc, vc in dense:
            kc[:, :, case.prefix] = k
            vc[:, :, case.prefix] = v
            F.scaled_dot_product_attention(qg, kc[:, :, :seq], vc[:, :, :seq], scale=scale)
        return clock() - t0

    def timed_build() -> float:
        t0 = clock()
        build()
        return clock() - t0

    variants: dict[str, Callable[[], float]] = {
        "build": timed_build, "reference": backend("reference"), "torch": backend("torch"),
        "sdpa": contiguous,
    }
    if e == 1:
        variants["sdpa_grp"] = grouped
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for name, fn in variants.items():
            best[name] = min(best[name], fn())
    per_layer = {n: t * 1e3 / args.layers for n, t in best.items() if n != "build"}
    per_layer["build"] = best["build"] * 1e3
    return per_layer


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for dname in args.dtypes.split(","):
        if dname not in DTYPES:
            print(f"unknown dtype {dname!r}; choose from {sorted(DTYPES)}", file=sys.stderr)
            return 2
        for case in cases(args):
            t = run_case(case, DTYPES[dname], args, clock)
            grp = t.get("sdpa_grp")
            rows.append([case.name, dname, f"{t['build']:.3f}", f"{t['reference']:.3f}",
                         f"{t['torch']:.3f}", f"{t['sdpa']:.3f}",
                         "-" if grp is None else f"{grp:.3f}", f"{t['torch'] / t['sdpa']:.2f}",
                         "-" if grp is None else f"{t['torch'] / grp:.2f}"])
            print(rows[-1], file=sys.stderr, flush=True)
    header = ["case", "dtype", "build ms", "reference ms/layer", "torch ms/layer",
              "sdpa ms/layer", "sdpa_grp ms/layer", "torch/sdpa", "torch/sdpa_grp"]
    print(f"threads={args.threads} clock={args.clock} layout={args.layout} layers={args.layers} rounds={args.rounds}")
    print(format_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
