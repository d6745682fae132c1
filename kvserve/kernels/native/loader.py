"""Finding, building and loading the native kernels: the sources, the compiler flags, the
per-user cache (keyed by the sources, the compiler, the flags and the CPU's flags), and the
process's one library handle (`_load`: empty where KVSERVE_NATIVE=0 is set; extra flags from
KVSERVE_NATIVE_FLAGS) with the C signatures declared on it. The wrappers call `_load`,
`available` and `limits` through this module, so that a test's stand-in library takes effect
everywhere. Knows nothing of tensors or of any one kernel's checks.
"""
from __future__ import annotations

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

from kvserve.kernels.native.abi import _I64, _KERNELS, _P, _Layer, _Step

log = logging.getLogger("kvserve.kernels")

_CSRC = Path(__file__).parents[1] / "csrc"  # kvserve/kernels/csrc: the package data
HEADERS = tuple(_CSRC / name for name in ("bf16.h", "scratch.h"))
SOURCES = tuple(_CSRC / name for name in ("decode_attention.c", "elementwise.c", "int4_mm.c",
                                          "decode_layer.c", "int8_mm.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-shared", "-fPIC")
"""Reassociation lets the compiler vectorize the dot products' sums; no finite-math
assumptions (the softmax starts from -inf)."""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


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
        getattr(lib, f"kvs_silu_mul_{kind}").argtypes = [_P, _P, _I64, _I64]
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
