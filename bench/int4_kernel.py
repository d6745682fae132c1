"""The native 4-bit kernel alone, as a decode step calls it: the default model's four
projections of 30 layers (random Q4_1 codes, each layer its own weights, about 66 MB, so
that they come from memory as in a step), called in layer order on M rows of float32
activations; prints the median and best of 7 passes (a 32 MB read before each evicts the
last pass's weights). A/B a kernel change by running this before and after it.

    .venv/bin/python bench/int4_kernel.py [--rows 1] [--passes 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_throughput import cpu_flags  # noqa: E402

from kvserve.kernels import native  # noqa: E402
from kvserve.model.quant import int4_blocks  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: [N, K]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    if not native.int4_available():
        print("this CPU's build has no 4-bit kernel", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(args.layers):
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            blocks = int4_blocks(q, torch.rand(n, k // 32, generator=gen) * 0.01,
                                 -torch.rand(n, k // 32, generator=gen) * 0.05)
            calls.append((native.Int4Weight(*blocks), torch.randn(args.rows, k, generator=gen)))
    evict = torch.randn(8 * 1024 * 1024)
    times = []
    for _ in range(args.passes):
        evict.sum()
        t = time.perf_counter()
        for weight, x in calls:
            weight(x)
        times.append(time.perf_counter() - t)
    print(f"cpu flags: {cpu_flags()}; build {['none', 'AVX-512 VNNI', 'AVX2'][native._load().kvs_int4_available()]}; "
          f"threads {torch.get_num_threads()}")
    print(f"{args.layers} layers x 4 projections, {args.rows} row(s): median {statistics.median(times) * 1e3:.2f} ms, "
          f"best {min(times) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
