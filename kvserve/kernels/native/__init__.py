"""C kernels for the CPU backend, compiled at first use for the CPU they run on.

`decode_attention` (csrc/decode_attention.c) attends decode queries to their requests'
K/V in place in the pool, reading each slot once, where the torch path gathers K/V copies
for `F.scaled_dot_product_attention` (issue 18); `store_rows` writes a step's K/V at its
slots; `rms_norm` and `rotary` (csrc/elementwise.c) are the model's row ops, one pass each
with torch's numbers, `silu_mul` the one-call layer's SiLU (its own exp), and `int4_mm`
(csrc/int4_mm.c) its 4-bit projections on 8-bit activations where the CPU has AVX-512
VNNI or AVX2, and `int8_mm` (csrc/int8_mm.c) its output head, 8-bit weights in groups of
32 on the same 8-bit activations (the runner hands them to the model:
`LlamaForCausalLM.use_row_ops`); `DecodeLayer` and `DecodeStep`
(csrc/decode_layer.c) run a whole decoder layer of a small decode step in one call on them.
The sources are built with the system C compiler (``cc -O3 -march=native -fopenmp``) into a
per-user cache keyed by the sources, the compiler, the flags and the CPU's flags, and loaded
with ctypes (no torch headers: the build takes about a second). OpenMP resolves to the
runtime torch has already loaded, so the kernels run on torch's threads
(`torch.set_num_threads`).

`available()` is False, and the backend keeps its torch path, where no compiler is found,
the build fails (logged once), or KVSERVE_NATIVE=0 is set (for A/B measurements).
KVSERVE_NATIVE_FLAGS adds compiler flags (``-mno-avx512f`` builds the portable paths, as on
an AVX2-only CPU). Imports only torch.

This package's face is the names below (`native.rms_norm`, `native.available()`, ...; the
model takes the package itself as its row ops); `loader` builds and holds the library,
`abi` has the C types and structures, and `attention`, `rows`, `weights` and `layer` wrap
the kernels.
"""

from __future__ import annotations

from kvserve.kernels.native.attention import DecodeAttention, decode_attention, supports
from kvserve.kernels.native.layer import DecodeLayer, DecodeStep
from kvserve.kernels.native.loader import (
    FLAGS,
    HEADERS,
    SOURCES,
    available,
    build,
    cache_dir,
    limits,
)
from kvserve.kernels.native.rows import rms_norm, rotary, row_argmax, rowwise, silu_mul, store_rows
from kvserve.kernels.native.weights import (
    Int4Weight,
    Int8Weight,
    int4_available,
    int4_mm,
    int8_available,
    int8_mm,
)

__all__ = [
    "FLAGS", "HEADERS", "SOURCES", "DecodeAttention", "DecodeLayer", "DecodeStep", "Int4Weight",
    "Int8Weight", "available", "build", "cache_dir", "decode_attention", "int4_available", "int4_mm",
    "int8_available", "int8_mm", "limits", "rms_norm", "rotary", "row_argmax", "rowwise", "silu_mul",
    "store_rows", "supports",
]
