"""The output head alone, as a decode step calls it: the default model's head [49,152, 576]
(random weights), torch's int8 kernel (`_weight_int8pack_mm`: one scale per output row,
bfloat16 activations) vs the native 8-bit kernel (csrc/int8_mm.c: groups of 32, 8-bit
activations), on M rows of float32 activations; prints the median and best of 7 passes of
each (a 32 MB read before each evicts the weights, 28 MB of int8, as a step's layers do),
the two alternating pass by pass. With --dense, also the float32 dense copy (`F.linear`, as
`HEAD_FLOAT_DENSE_ROWS` / `NATIVE_HEAD_FLOAT_DENSE_ROWS` weigh it). With --projections, the
default model's four projections of 30 layers instead of the head, called in layer order (an
int8 model: `quant.NATIVE_INT8_FLOAT_DENSE_ROWS` weighs that). A/B a kernel change by running
this before and after it.

    .venv/bin/python bench/int8_head.py [--rows 1 8 32] [--passes 7] [--dense] [--projections] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_throughput import cpu_flags  # noqa: E402

from kvserve.kernels import native  # noqa: E402
from kvserve.kernels.native.loader import _load  # noqa: E402
from kvserve.model.quant import Int8Linear, int8_dequantized  # noqa: E402

VOCAB, HIDDEN = 49152, 576  # SmolLM2-135M's tied embedding
PROJECTIONS = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: [N, K]


def timed(fn: Callable[[], object], evict: torch.Tensor) -> float:
    """Seconds for one call of `fn` with the weights evicted from the caches first."""
    evict.sum()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--dense", action="store_true", help="also time the float32 dense copy")
    ap.add_argument("--projections", action="store_true", help="the default model's projections, not the head")
    ap.add_argument("--threads", type=int, default=0, help="torch's threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.int8_available():
        print("this CPU's build has no 8-bit kernel", file=sys.stderr)
        return 1
    shapes = [shape for _ in range(30) for shape in PROJECTIONS] if args.projections else [(VOCAB, HIDDEN)]
    gen = torch.Generator().manual_seed(0)
    weights = []  # (torch's per-row codes and scales, the native kernel, the dense copy or None)
    for n, k in shapes:
        lin = Int8Linear(torch.randn(n, k, generator=gen) * 0.05, None, groups=True)
        weights.append((lin.qweight, lin.scales, native.Int8Weight(*lin.groups),
                        int8_dequantized(*lin.groups) if args.dense else None))
    what = "30 layers x 4 projections" if args.projections else f"head [{VOCAB}, {HIDDEN}]"
    evict = torch.randn(8 * 1024 * 1024)
    print(f"cpu flags: {cpu_flags()}; build {['none', 'AVX-512 VNNI', 'AVX2'][_load().kvs_int8_available()]}; "
          f"threads {torch.get_num_threads()}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) for k in {k for _, k in shapes}}
        runs: dict[str, Callable[[], object]] = {
            "torch int8": lambda xs=xs: [torch._weight_int8pack_mm(xs[q.shape[1]].to(torch.bfloat16), q, s).float()
                                   for q, s, _, _ in weights],
            "native int8": lambda xs=xs: [kernel(xs[kernel.k]) for _, _, kernel, _ in weights],
        }
        if args.dense:
            runs["float32 dense"] = lambda xs=xs: [F.linear(xs[w.shape[1]], w) for _, _, _, w in weights]
        times: dict[str, list[float]] = {name: [] for name in runs}
        for fn in runs.values():
            fn()  # warm-up: scratch, threads
        for _ in range(args.passes):
            for name, fn in runs.items():
                times[name].append(timed(fn, evict))
        base = statistics.median(times["torch int8"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{what}, {rows:3d} row(s), {name:13s}: median {med * 1e3:7.2f} ms, "
                  f"best {min(ts) * 1e3:7.2f} ms ({med / base:.2f}x torch's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
