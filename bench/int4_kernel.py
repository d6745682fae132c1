"""The native 4-bit kernel alone, as a step calls it: the default model's four projections
of 30 layers (random Q4_1 codes, each layer its own weights, about 66 MB, so that they come
from memory as in a step), called in layer order on M rows of float32 activations; prints
the median and best of the passes (a 32 MB read before each evicts the last pass's
weights). With --dense, also the float32 dense copy (`F.linear` on the same shapes, 424 MB
for 30 layers), the two alternating pass by pass: what `quant.NATIVE_INT4_FLOAT_DENSE_ROWS`
weighs. A/B a kernel change by running this before and after it.

    .venv/bin/python bench/int4_kernel.py [--rows 1 8 32] [--passes 7] [--layers 30] [--dense]
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
from kvserve.model.quant import int4_blocks  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: [N, K]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dense", action="store_true", help="also time the float32 dense copy")
    args = ap.parse_args()
    if not native.int4_available():
        print("this CPU's build has no 4-bit kernel", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    weights = []  # (the native kernel, the float32 dense copy or None, K)
    for _ in range(args.layers):
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            scale = torch.rand(n, k // 32, generator=gen) * 0.01
            low = -torch.rand(n, k // 32, generator=gen) * 0.05
            dense = None
            if args.dense:
                dense = (q.float().view(n, k // 32, 32) * scale[..., None] + low[..., None]).view(n, k)
            weights.append((native.Int4Weight(*int4_blocks(q, scale, low)), dense, k))
    evict = torch.randn(8 * 1024 * 1024)
    print(f"cpu flags: {cpu_flags()}; build {['none', 'AVX-512 VNNI', 'AVX2'][_load().kvs_int4_available()]}; "
          f"threads {torch.get_num_threads()}")
    kinds: dict[str, Callable[[torch.Tensor, tuple], object]] = {"native int4": lambda x, w: w[0](x)}
    if args.dense:
        kinds["float32 dense"] = lambda x, w: F.linear(x, w[1])
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.passes):
            for name, call in kinds.items():
                evict.sum()
                t = time.perf_counter()
                for w in weights:
                    call(xs[w[2]], w)
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            print(f"{args.layers} layers x 4 projections, {rows} row(s), {name}: "
                  f"median {statistics.median(ts) * 1e3:.2f} ms, best {min(ts) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
