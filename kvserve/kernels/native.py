"""C kernels for the CPU backend, compiled at first use for the CPU they run on.

`decode_attention` (csrc/decode_attention.c) attends decode queries to their requests'
K/V in place in the pool, reading each slot once, where the torch path gathers K/V copies
for `F.scaled_dot_product_attention` (issue 18); `store_rows` writes a step's K/V at its
slots; `rms_norm` and `rotary` (csrc/elementwise.c) are the model's row ops, one pass each
with torch's numbers, and `int4_mm` (csrc/int4_mm.c) its 4-bit projections on 8-bit
activations where the CPU has AVX-512 VNNI or AVX2, and `int8_mm` (csrc/int8_mm.c) its
output head, 8-bit weights in groups of 32 on the same 8-bit activations (the runner hands
them to the model: `LlamaForCausalLM.use_row_ops`); `DecodeLayer` and `DecodeStep`
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
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("kvserve.kernels")

HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("bf16.h", "scratch.h"))
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("decode_attention.c", "elementwise.c", "int4_mm.c", "decode_layer.c",
                              "int8_mm.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-shared", "-fPIC")
"""Reassociation lets the compiler vectorize the dot products' sums; no finite-math
assumptions (the softmax starts from -inf)."""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_KERNELS = {torch.bfloat16: "kvs_decode_attention_bf16", torch.float32: "kvs_decode_attention_f32"}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _traced(name: str) -> contextlib.AbstractContextManager:
    """A torch.profiler range named `name` while a profiler runs; nothing otherwise (a
    record_function costs microseconds even with no profiler, and the decode step makes
    hundreds of kernel calls)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve" / "native"


def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile (or find in the cache) and load the kernels; None, logged, where that fails.
    `extra_flags` follow FLAGS (tests build the portable path with ``-mno-avx512f``)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.warning("no C compiler found: the CPU backend and the model run torch's ops")
        return None
    flags = FLAGS + tuple(extra_flags)
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu_flags().encode(),
                                     " ".join(flags).encode()])).hexdigest()[:20]
    target = cache_dir() / f"kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        run = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                             text=True, check=False)
        if run.returncode != 0:
            os.unlink(tmp)
            log.warning("building the native CPU kernels failed (the torch paths run): %s",
                        run.stderr.strip()[-2000:])
            return None
        os.replace(tmp, target)  # atomic: processes building at once each load a whole file
    lib = ctypes.CDLL(str(target))
    for name in _KERNELS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                       ctypes.c_float]
    for kind in ("bf16", "f32"):
        getattr(lib, f"kvs_rms_norm_{kind}").argtypes = [_P, _P, _P, _I64, _I64, _I64, ctypes.c_float]
        getattr(lib, f"kvs_rotary_{kind}").argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64]
    lib.kvs_store_rows.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64]
    for kind in ("bf16", "f32"):
        getattr(lib, f"kvs_row_argmax_{kind}").argtypes = [_P, _I64, _I64, _I64, _P, _P]
    lib.kvs_limits.argtypes = [ctypes.POINTER(_I64), ctypes.POINTER(_I64)]
    lib.kvs_avx512_bf16.restype = ctypes.c_int
    lib.kvs_int4_available.restype = ctypes.c_int
    lib.kvs_int4_mm.restype = ctypes.c_int
    lib.kvs_int4_mm.argtypes = [_P, ctypes.c_int, _I64, _I64, _I64, _P, _P, _P, _I64, _P, ctypes.c_int]
    lib.kvs_int8_available.restype = ctypes.c_int
    lib.kvs_int8_mm.restype = ctypes.c_int
    lib.kvs_int8_mm.argtypes = [_P, ctypes.c_int, _I64, _I64, _I64, _P, _P, _I64, _P, ctypes.c_int]
    lib.kvs_decode_layer.restype = ctypes.c_int
    lib.kvs_decode_layer.argtypes = [_P, ctypes.c_int, ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _P, _P,
                                     ctypes.POINTER(_I64)]
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("KVSERVE_NATIVE", "1") != "0":
                try:
                    _lib = build(tuple(os.environ.get("KVSERVE_NATIVE_FLAGS", "").split()))
                except OSError as e:
                    log.warning("loading the native CPU kernels failed (the torch path runs): %s", e)
            _tried = True
    return _lib


@functools.cache
def limits() -> tuple[int, int]:
    """(largest q heads per KV head, largest head_dim) the decode attention takes."""
    lib = _load()
    if lib is None:
        return 0, 0
    g, d = _I64(), _I64()
    lib.kvs_limits(ctypes.byref(g), ctypes.byref(d))
    return g.value, d.value


def available() -> bool:
    return _load() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these (CPU, bf16 or fp32, head counts and D in bounds)."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in _KERNELS or not available():
        return False
    max_group, max_d = limits()
    hq, hkv, d = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    return hq % hkv == 0 and hq // hkv <= max_group and d <= max_d


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                     sm_scale: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] (cache dtype): row b attends to the K/V at slots
    req_to_token[rows[b], :lens[b]] of k_cache/v_cache [size, Hkv, D]. `rows` and `lens` are
    int64 [B]; ValueError names a slot outside the pool. `lib`: another build (tests). A
    step's layers share `rows` and `lens`: `DecodeAttention` checks those once."""
    return DecodeAttention(req_to_token, rows, lens, lib)(q, k_cache, v_cache, sm_scale)


_LAYOUT = "decode_attention: contiguous caches, int32 req_to_token, int64 rows/lens"


class DecodeAttention:
    """`decode_attention` bound to one step's requests (req_to_token, rows, lens: checked
    here once), called per layer with (q, k_cache, v_cache, sm_scale)."""

    __slots__ = ("_lib", "_r2t", "_rows", "_lens", "_args")

    def __init__(self, req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                 lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib or _load()
        assert self._lib is not None, "decode_attention called where available() is False"
        if not (req_to_token.is_contiguous() and req_to_token.dtype == torch.int32 and req_to_token.dim() == 2
                and rows.dtype == torch.int64 and lens.dtype == torch.int64 and rows.dim() == 1
                and rows.shape == lens.shape and rows.is_contiguous() and lens.is_contiguous()):
            raise ValueError(_LAYOUT)
        self._r2t, self._rows, self._lens = req_to_token, rows, lens
        self._args = (req_to_token.data_ptr(), req_to_token.shape[0], req_to_token.shape[1],
                      rows.data_ptr(), lens.data_ptr(), rows.shape[0])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sm_scale: float) -> torch.Tensor:
        dtype = k_cache.dtype
        if q.dtype != dtype or not q.is_contiguous():
            q = q.to(dtype).contiguous()
        b, hq, d = q.shape
        size, hkv, _ = k_cache.shape
        if not (b == self._args[-1] and dtype in _KERNELS and k_cache.is_contiguous() and v_cache.is_contiguous()
                and v_cache.shape == k_cache.shape and v_cache.dtype == dtype):
            raise ValueError(f"{_LAYOUT}, q [{self._args[-1]}, Hq, D]")
        out = torch.empty_like(q)
        with _traced("kvserve::decode_attention"):
            bad = getattr(self._lib, _KERNELS[dtype])(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), *self._args,
                hq, hkv, d, size, sm_scale)
        if bad < 0:
            row = -bad - 1
            raise ValueError(f"decode_attention: batch row {row} names row {int(self._rows[row])} or length "
                             f"{int(self._lens[row])} outside req_to_token {tuple(self._r2t.shape)}")
        if bad:
            raise ValueError(f"decode_attention: batch row {bad - 1} has a slot outside the pool of {size}")
        return out


def rowwise(x: torch.Tensor) -> bool:
    """Whether `rms_norm` and `rotary` take `x` (a contiguous bf16 or fp32 CPU tensor)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and x.is_contiguous() and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, normalised in float32 and rounded to x's
    dtype before the weight, as transformers' LlamaRMSNorm (`rowwise(x)` must hold)."""
    dim = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (dim,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous [{dim}] {x.dtype}")
    out = torch.empty_like(x)
    rows = x.numel() // dim if dim else 0
    _row_fns(_load())[x.dtype][0](x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, dim, eps)
    return out


@functools.cache
def _row_fns(lib: ctypes.CDLL | None) -> dict[torch.dtype, tuple]:
    """{dtype: (rms_norm, rotary)} of a build."""
    assert lib is not None
    return {dtype: (getattr(lib, "kvs_rms_norm_" + sfx), getattr(lib, "kvs_rotary_" + sfx))
            for dtype, sfx in _SUFFIX.items()}


def rotary(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """The first `heads` heads of each row of x [T, >= heads * D] (rows may be strided, the
    values of a row contiguous) rotated in the rotate-half layout by their positions
    (int64 [T]) with float32 cos/sin tables [P, D/2], rounding as torch's ops in x's dtype
    do -> [T, heads, D]. ValueError names a position outside the tables."""
    lib = _load()
    assert lib is not None
    tokens = x.shape[0]
    half = cos.shape[1]
    d = 2 * half
    if not (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] >= heads * d and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.shape == (tokens,)):
        raise ValueError("rotary: x [T, >= heads*D] with contiguous rows, float32 tables [P, D/2], "
                         "int64 positions [T]")
    out = x.new_empty(tokens, heads, d)
    bad = _row_fns(lib)[x.dtype][1](
        x.data_ptr(), x.stride(0), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        positions.data_ptr(), tokens, heads, d)
    if bad:
        raise ValueError(f"rotary: position {int(positions[bad - 1])} of token {bad - 1} is outside "
                         f"the tables of {cos.shape[0]}")
    return out


def row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For each row of x [B, V] (float32 or bfloat16 on the CPU, each row contiguous): the
    index of its first largest value (int64 [B], torch's argmax) and whether all its values
    are finite (bool [B]; a row that is not gets index 0), in one pass over the row: greedy
    sampling's read of a step's logits. None where the native kernels are not there or x is
    not such a tensor."""
    if not (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] > 0 and available()):
        return None
    rows = x.shape[0]
    index = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.bool)
    getattr(_load(), "kvs_row_argmax_" + _SUFFIX[x.dtype])(
        x.data_ptr(), rows, x.shape[1], x.stride(0), index.data_ptr(), finite.data_ptr())
    return index, finite


def store_rows(src: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor) -> None:
    """cache[loc[t]] = src[t] for src [T, *row] (each token's row contiguous, tokens may be
    strided) into cache [size, *row] of the same dtype (contiguous), loc int64 [T]: a
    step's new K or V at their slots. ValueError names a slot outside the cache (then
    nothing is written)."""
    lib = _load()
    assert lib is not None
    tokens = src.shape[0]
    row = cache[0].numel() if cache.shape[0] else 0
    if not (src.dim() >= 2 and src.dtype == cache.dtype and cache.is_contiguous()
            and src.shape[1:] == cache.shape[1:]
            and (tokens == 0 or src.stride()[1:] == cache.stride()[1:] or src[0].is_contiguous())
            and loc.dtype == torch.int64 and loc.is_contiguous() and loc.shape == (tokens,)
            and src.device == cache.device):
        raise ValueError("store_rows: src [T, *row] with contiguous rows, cache [size, *row] "
                         "contiguous of the same dtype, int64 loc [T]")
    size = src.element_size()
    bad = lib.kvs_store_rows(src.data_ptr(), src.stride(0) * size, cache.data_ptr(), cache.shape[0],
                             loc.data_ptr(), tokens, row * size)
    if bad:
        raise ValueError(f"store_rows: slot {int(loc[bad - 1])} of token {bad - 1} is outside the "
                         f"cache of {cache.shape[0]}")


def int4_available() -> bool:
    """Whether `int4_mm` runs here (the build targets AVX-512 BW, VL and VNNI, or AVX2)."""
    lib = _load()
    return lib is not None and bool(lib.kvs_int4_available())


def int4_mm(x: torch.Tensor, nib: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
            lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, rows contiguous) @ W.T -> [M, N] in x's dtype, for the 4-bit
    weight W in `kvserve.model.quant.int4_blocks`' layout: `nib` uint8 [N, K/2], the groups'
    scales `d` and minima `m` float16 [N, K/32]. The activations are quantized to 8 bits per
    group of 32 (csrc/int4_mm.c); each row's result depends on that row alone. `lib`: another
    build (tests). One weight multiplied many times: `Int4Weight`, which checks it once."""
    return Int4Weight(nib, d, m, lib)(x)


class _NativeWeight:
    """A weight checked once for one of the weight-only kernels (`int4_mm`, `int8_mm`: the same
    C signature after the weight's own pointers); calling it with x [M, K] multiplies."""

    __slots__ = ("n", "k", "_fn", "_weight", "_keep")
    _name = ""  # the kernel's, for the errors and the profiler

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dim() == 2 and x.shape[1] == self.k and x.dtype in _SUFFIX and x.stride(1) == 1
                and x.device.type == "cpu"):
            raise ValueError(f"{self._name}: x [M, {self.k}] bf16 or fp32 with contiguous rows, got x "
                             f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
        y = x.new_empty(x.shape[0], self.n)
        bf16 = x.dtype == torch.bfloat16
        with _traced(f"kvserve::{self._name}"):
            rc = self._fn(x.data_ptr(), bf16, x.stride(0), x.shape[0], self.k, *self._weight, y.data_ptr(), bf16)
        if rc:
            raise MemoryError(f"{self._name}: no scratch for {x.shape[0]} rows of {self.k}")
        return y


class Int4Weight(_NativeWeight):
    """A 4-bit weight checked once for `int4_mm`; calling it with x [M, K] multiplies (a
    decode step makes one call per projection and layer: 4 per layer, each a few
    microseconds of kernel, so the per-call Python is kept to a few checks of x)."""

    __slots__ = ()
    _name = "int4_mm"

    def __init__(self, nib: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 lib: ctypes.CDLL | None = None) -> None:
        lib = lib or _load()
        assert lib is not None, "int4_mm called where available() is False"
        n, half = nib.shape if nib.dim() == 2 else (0, -1)
        k = 2 * half
        if not (nib.device.type == "cpu" and nib.dtype == torch.uint8 and nib.is_contiguous()
                and k > 0 and k % 64 == 0 and d.dtype == m.dtype == torch.float16
                and d.shape == m.shape == (n, k // 32) and d.is_contiguous() and m.is_contiguous()):
            raise ValueError(f"int4_mm: nib uint8 [N, K/2] with K a multiple of 64, d and m float16 "
                             f"[N, K/32]; got nib {tuple(nib.shape)} {nib.dtype}, d {tuple(d.shape)} "
                             f"{d.dtype}, m {tuple(m.shape)} {m.dtype}")
        if not lib.kvs_int4_available():
            raise ValueError("int4_mm: this build has no 4-bit kernel (int4_available() is False)")
        self.n, self.k = n, k
        self._fn = lib.kvs_int4_mm
        self._weight = (nib.data_ptr(), d.data_ptr(), m.data_ptr(), n)
        self._keep = (nib, d, m)  # the pointers' owners


def int8_available() -> bool:
    """Whether `int8_mm` runs here (the build targets AVX-512 BW, VL and VNNI, or AVX2)."""
    lib = _load()
    return lib is not None and bool(lib.kvs_int8_available())


def int8_mm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, rows contiguous) @ W.T -> [M, N] in x's dtype, for the weight
    W = d * q in groups of 32 inputs per output row (GGUF Q8_0's shape): `q` int8 [N, K], the
    groups' scales `d` float16 [N, K/32], both row-major (`kvserve.model.quant.int8_groups`).
    The activations are quantized to 8 bits per group of 32 (csrc/int8_mm.c); each row's
    result depends on that row alone. `lib`: another build (tests). One weight multiplied
    many times: `Int8Weight`, which checks it once."""
    return Int8Weight(q, d, lib)(x)


class Int8Weight(_NativeWeight):
    """An 8-bit weight in groups of 32 checked once for `int8_mm`; calling it with x [M, K]
    multiplies (the output head: one call per decode step)."""

    __slots__ = ()
    _name = "int8_mm"

    def __init__(self, q: torch.Tensor, d: torch.Tensor, lib: ctypes.CDLL | None = None) -> None:
        lib = lib or _load()
        assert lib is not None, "int8_mm called where available() is False"
        n, k = q.shape if q.dim() == 2 else (0, -1)
        if not (q.device.type == "cpu" and q.dtype == torch.int8 and q.is_contiguous() and k > 0
                and k % 32 == 0 and d.dtype == torch.float16 and d.shape == (n, k // 32)
                and d.is_contiguous() and d.device.type == "cpu"):
            raise ValueError(f"int8_mm: q int8 [N, K] with K a multiple of 32, d float16 [N, K/32]; "
                             f"got q {tuple(q.shape)} {q.dtype}, d {tuple(d.shape)} {d.dtype}")
        if not lib.kvs_int8_available():
            raise ValueError("int8_mm: this build has no 8-bit kernel (int8_available() is False)")
        self.n, self.k = n, k
        self._fn = lib.kvs_int8_mm
        self._weight = (q.data_ptr(), d.data_ptr(), n)
        self._keep = (q, d)  # the pointers' owners


class _Int4(ctypes.Structure):
    _fields_ = [("nib", _P), ("d", _P), ("m", _P), ("n", _I64), ("k", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Int4), ("o", _Int4), ("gate_up", _Int4),
                ("down", _Int4), ("eps", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("inter", _I64), ("positions", _P), ("cos", _P), ("sin", _P), ("table_rows", _I64),
                ("loc", _P), ("req_to_token", _P), ("r2t_rows", _I64), ("r2t_stride", _I64), ("rows", _P),
                ("lens", _P), ("pool_size", _I64), ("sm_scale", ctypes.c_float)]


class DecodeLayer:
    """One Llama decoder layer's weights bound for `DecodeStep.run` (csrc/decode_layer.c): the
    RMS norms' weights [hidden] in the model dtype, their epsilon, and the four projections
    as `Int4Weight`s (qkv [(heads + 2 kv_heads) * head_dim, hidden], o [hidden, heads *
    head_dim], gate_up [2 inter, hidden], down [hidden, inter]); no biases."""

    __slots__ = ("dtype", "dims", "_layer", "_keep")

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, qkv: Int4Weight,
                 o: Int4Weight, gate_up: Int4Weight, down: Int4Weight, *, heads: int, kv_heads: int,
                 head_dim: int) -> None:
        if not (kv_heads > 0 and heads > 0 and head_dim > 0 and input_norm.dim() == 1):
            raise ValueError(f"DecodeLayer: heads={heads}, kv_heads={kv_heads} and head_dim={head_dim} must be "
                             f"positive, the norm weights 1-D")
        hidden, inter = input_norm.shape[0], down.k
        want = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        got = {"qkv": (qkv.n, qkv.k), "o": (o.n, o.k), "gate_up": (gate_up.n, gate_up.k), "down": (down.n, down.k)}
        if got != want:
            raise ValueError(f"DecodeLayer: projections [N, K] {got} do not fit heads={heads}, "
                             f"kv_heads={kv_heads}, head_dim={head_dim}, hidden={hidden}: want {want}")
        norms = (input_norm, post_norm)
        if not all(w.dim() == 1 and w.shape == (hidden,) and w.dtype == input_norm.dtype and w.dtype in _SUFFIX
                   and w.is_contiguous() and w.device.type == "cpu" for w in norms):
            raise ValueError(f"DecodeLayer: norm weights must be contiguous [{hidden}] bf16 or fp32 CPU "
                             f"tensors of one dtype")
        if head_dim % 2 or head_dim > limits()[1] or heads % kv_heads or heads // kv_heads > limits()[0]:
            raise ValueError(f"DecodeLayer: decode attention does not take heads={heads}, kv_heads={kv_heads}, "
                             f"head_dim={head_dim}")
        self.dtype = input_norm.dtype
        self.dims = (hidden, heads, kv_heads, head_dim, inter)
        self._layer = _Layer(input_norm.data_ptr(), post_norm.data_ptr(), *(_Int4(*w._weight, w.k) for w in
                             (qkv, o, gate_up, down)), eps)
        self._keep = (tuple(w.detach() for w in norms), qkv, o, gate_up, down)  # the storages pointed at


_LAYER_ERRORS = {
    2: "position {v} of token {i} is outside the rotary tables of {tables}",
    3: "slot {v} of token {i} is outside the pool of {size}",
    4: "token {i} names row {v} of req_to_token or a length outside its bounds",
    5: "token {i}'s request has a slot outside the pool of {size}",
    6: "the 4-bit kernel refused a projection (no kernel in this build, or its K)",
}


class DecodeStep:
    """One decode step's inputs for `DecodeLayer`s, checked once: token t of x [T, hidden]
    is a request at row `rows[t]` of `req_to_token` (int32) whose new K/V go to slot `loc[t]`
    at position `positions[t]` and which attends to its first `lens[t]` slots; cos/sin
    float32 rotary tables [P, head_dim / 2]. `run` applies one layer to x in place (the
    runner's lease check goes between layers: every layer stores K/V)."""

    __slots__ = ("_lib", "_step", "_err", "_keep", "_vals", "dims")

    def __init__(self, dims: tuple[int, ...], *, positions: torch.Tensor, loc: torch.Tensor,
                 req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, sm_scale: float, pool_size: int) -> None:
        self._lib = _load()
        assert self._lib is not None, "DecodeStep made where available() is False"
        tokens = positions.shape[0] if positions.dim() == 1 else -1
        ints = (positions, loc, rows, lens)
        if len(dims) != 5:
            raise ValueError(f"DecodeStep: dims (hidden, heads, kv_heads, head_dim, inter), got {dims}")
        if not (all(v.dtype == torch.int64 and v.shape == (tokens,) and v.is_contiguous() for v in ints)
                and req_to_token.dtype == torch.int32 and req_to_token.dim() == 2 and req_to_token.is_contiguous()
                and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.dim() == 2
                and cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] * 2 == dims[3]
                and all(t.device.type == "cpu" for t in (*ints, req_to_token, cos, sin))):
            raise ValueError("DecodeStep: int64 positions, loc, rows and lens [T], int32 req_to_token "
                             "[rows, stride], float32 cos/sin [P, head_dim/2], all contiguous CPU tensors")
        hidden, heads, kv_heads, head_dim, inter = dims
        self.dims = dims
        self._step = _Step(tokens, hidden, heads, kv_heads, head_dim, inter, positions.data_ptr(), cos.data_ptr(),
                           sin.data_ptr(), cos.shape[0], loc.data_ptr(), req_to_token.data_ptr(),
                           req_to_token.shape[0], req_to_token.shape[1], rows.data_ptr(), lens.data_ptr(),
                           pool_size, sm_scale)
        self._err = _I64()
        self._keep = (positions, loc, req_to_token, rows, lens, cos, sin)
        self._vals = {2: positions, 3: loc, 4: rows}

    def run(self, layer: DecodeLayer, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """x [T, hidden] (the layer's dtype, contiguous) through `layer` in place, storing its
        K/V in k_cache/v_cache [pool_size, kv_heads, head_dim]. ValueError names what was out
        of bounds (nothing stored when a position or slot is)."""
        hidden, _, kv_heads, head_dim, _ = self.dims
        size = self._step.pool_size
        if not (layer.dims == self.dims and x.dtype == layer.dtype and x.is_contiguous()
                and x.shape == (self._step.tokens, hidden) and x.device.type == "cpu"
                and all(c.dtype == x.dtype and c.is_contiguous() and c.shape == (size, kv_heads, head_dim)
                        and c.device.type == "cpu" for c in (k_cache, v_cache))):
            raise ValueError(f"DecodeStep.run: x [{self._step.tokens}, {hidden}] and caches "
                             f"[{size}, {kv_heads}, {head_dim}] contiguous on the CPU in the layer's {layer.dtype}")
        with _traced("kvserve::decode_layer"):
            rc = self._lib.kvs_decode_layer(x.data_ptr(), x.dtype == torch.bfloat16, ctypes.byref(layer._layer),
                                            ctypes.byref(self._step), k_cache.data_ptr(), v_cache.data_ptr(),
                                            ctypes.byref(self._err))
        if rc == 1:
            raise MemoryError(f"decode_layer: no scratch for {self._step.tokens} rows")
        if rc:
            i = self._err.value
            vals = self._vals.get(rc)
            raise ValueError("decode_layer: " + _LAYER_ERRORS[rc].format(
                i=i, v=int(vals[i]) if vals is not None else "", tables=self._step.table_rows, size=size))
