"""Compile the Triton kernels for a CUDA GPU on a host without one.

The public functions (`store_kv`, `decode_attention`, `extend_attention`) are called on
CPU tensors with their kernels swapped for recorders, so every launch is captured with
the exact constexprs, dtypes and `num_warps` its launcher chose.  Each captured launch is
then handed to the real Triton compiler for a CUDA target (TTIR -> TTGIR -> LLVM -> PTX ->
cubin through the `ptxas` bundled with Triton), and its resource usage is read from
ptxas's own report (registers, stack frame, spill stores).  Nothing runs on a GPU: this proves the kernels
compile and fit a device's limits, not that their results are right.

Run it as its own process, without TRITON_INTERPRET (the interpreter rewrites
triton.language's own jit helpers, which the compiler then cannot use):
`.venv/bin/python -m tests.kernels.cuda_compile` from the repo root prints a table for every
shape, dtype and architecture; `--json --case 90:llama3-8b:bf16` gives records.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.kernels import decode as decode_mod
from kvserve.kernels import extend as extend_mod
from kvserve.kernels import store_kv as store_kv_mod

KERNELS = (
    (store_kv_mod, "_store_kv_kernel"),
    (decode_mod, "_decode_split_kernel"),
    (decode_mod, "_decode_merge_kernel"),
    (extend_mod, "_extend_kernel"),
)

_POINTER_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass
class Launch:
    """One kernel launch as its launcher made it."""

    fn: object  # the kernel's Python function
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict


@dataclass
class Resources:
    """What one compiled kernel needs from the device."""

    name: str
    registers: int
    shared: int  # bytes, as Triton allocates it at launch
    spills: int  # bytes of spill stores per thread (ptxas -v)
    stack: int  # bytes of stack frame per thread
    num_warps: int


class _Recorder:
    def __init__(self, kernel: object, sink: list[Launch]) -> None:
        self._fn = kernel.fn  # JITFunction and InterpretedFunction both keep it here
        self._sink = sink

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args, **kwargs) -> None:
            self._sink.append(Launch(self._fn, tuple(grid), args, dict(kwargs)))

        return launch


@contextmanager
def captured_launches() -> Iterator[list[Launch]]:
    """Within the block, kernel launches are recorded instead of run."""
    sink: list[Launch] = []
    saved = [(module, name, getattr(module, name)) for module, name in KERNELS]
    try:
        for module, name, kernel in saved:
            setattr(module, name, _Recorder(kernel, sink))
        yield sink
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def _arg_type(name: str, value: object) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POINTER_TYPES:
            raise TypeError(f"argument {name}: no Triton pointer type for {value.dtype}")
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type {type(value).__name__} for a launch")


def compile_launch(launch: Launch, capability: int = 90) -> Resources:
    """Compile one captured launch for `sm_<capability>`; raises on any compile error.

    Triton runs ptxas with -v; TRITON_DUMP_PTXAS_LOG makes it print that report, and
    TRITON_ALWAYS_COMPILE keeps a cached cubin from hiding it.
    """
    jit = triton.JITFunction(launch.fn)
    kwargs = dict(launch.kwargs)
    options = {key: kwargs.pop(key) for key in _LAUNCH_OPTIONS if key in kwargs}
    names = jit.arg_names
    if len(launch.args) + len(kwargs) != len(names):
        raise TypeError(f"{jit.__name__}: {len(launch.args)} + {len(kwargs)} arguments for {names}")
    values = dict(zip(names, launch.args, strict=False)) | kwargs
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    for name in names:
        if name in kwargs:  # launchers pass exactly the tl.constexpr parameters by keyword
            signature[name] = "constexpr"
            constexprs[name] = kwargs[name]
        else:
            signature[name] = _arg_type(name, values[name])
    os.environ.update(TRITON_DUMP_PTXAS_LOG="1", TRITON_ALWAYS_COMPILE="1")
    log = io.StringIO()
    with redirect_stdout(log):
        kernel = triton.compile(ASTSource(jit, signature, constexprs),
                                target=GPUTarget("cuda", capability, 32), options=options)
    return _resources(kernel, log.getvalue())


def _resources(kernel: triton.compiler.CompiledKernel, ptxas_log: str) -> Resources:
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", ptxas_log)
    if regs is None or frame is None:
        raise RuntimeError(f"no ptxas report for {kernel.metadata.name}:\n{ptxas_log}")
    return Resources(
        name=kernel.metadata.name,
        registers=int(regs.group(1)),
        shared=int(kernel.metadata.shared),
        spills=int(frame.group(2)),
        stack=int(frame.group(1)),
        num_warps=int(kernel.metadata.num_warps),
    )


@dataclass(frozen=True)
class Shape:
    """Attention shape of a model: query heads, KV heads, head dim."""

    label: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = (
    Shape("llama3-8b", 32, 8, 128),
    Shape("smollm2", 9, 3, 64),
    Shape("qwen2-7b", 28, 4, 128),
    Shape("phi-2", 32, 32, 80),
    Shape("gqa-96", 16, 2, 96),
    Shape("odd-13", 6, 2, 13),
)


def launches_for(shape: Shape, dtype: torch.dtype) -> list[Launch]:
    """The launches of a decode step and of a store_kv + extend step.

    The decode batch has sequences of 3000 and 1200 tokens; the extend batch has a cached
    prefix and a chunk spanning several query tiles.  store_kv is captured once: a decode
    step launches the same kernel with the same constexprs and argument types.
    """
    from kvserve.kernels import build_step_metadata
    from kvserve.kernels.metadata import DecodeWorkspace

    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    req_to_token = torch.arange(4 * 4096, dtype=torch.int32).reshape(4, 4096)
    cache = torch.zeros(4 * 4096, hkv, d, dtype=dtype)
    ws = DecodeWorkspace.create(max_batch=4, num_q_heads=hq, head_dim=d, dtype=dtype,
                                device="cpu", max_splits=32)
    steps = (([3000, 1200], [1, 1]), ([700, 0], [300, 129]))
    with captured_launches() as sink:
        for prefix, extend in steps:
            meta = build_step_metadata(req_to_token=req_to_token, req_pool_indices=[1, 3],
                                 prefix_lens=prefix, extend_lens=extend, num_q_heads=hq,
                                 head_dim=d, device="cpu", workspace=ws, num_kv_heads=hkv)
            t = meta.num_tokens
            q = torch.zeros(t, hq, d, dtype=dtype)
            kv = torch.zeros(t, hkv, d, dtype=dtype)
            if meta.is_decode:
                decode_mod.decode_attention(q, k_cache=cache, v_cache=cache, meta=meta,
                                            sm_scale=d**-0.5)
            else:
                store_kv_mod.store_kv(kv, kv, k_cache=cache, v_cache=cache,
                                      out_cache_loc=meta.out_cache_loc)
                extend_mod.extend_attention(q, k_cache=cache, v_cache=cache, meta=meta,
                                            sm_scale=d**-0.5)
    return sink


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compile_case(
    case: str, overrides: dict[str, dict[str, int]] | None = None, only: str | None = None
) -> list[dict]:
    """Compile the launches of case "CAPABILITY:SHAPE:DTYPE" (e.g. "90:llama3-8b:bf16").

    `overrides` maps a kernel name to keyword arguments replacing its launcher's choice.
    `only` keeps the launches of one kernel.  Returns one record per launch: resources, or
    the compiler's error.
    """
    capability, label, dtype = case.split(":")
    shape = next(s for s in SHAPES if s.label == label)
    records = []
    for launch in launches_for(shape, DTYPES[dtype]):
        if only is not None and launch.fn.__name__ != only:
            continue
        launch.kwargs.update((overrides or {}).get(launch.fn.__name__, {}))
        record = {"case": case, "kernel": launch.fn.__name__,
                  "constexprs": sorted(k for k in launch.kwargs if not k.startswith("num_"))}
        try:
            usage = compile_launch(launch, int(capability))
        except Exception as exc:  # noqa: BLE001 - reported per launch, the caller asserts
            record["error"] = f"{type(exc).__name__}: {exc}"
        else:
            record.update(registers=usage.registers, shared=usage.shared, spills=usage.spills,
                          stack=usage.stack, num_warps=usage.num_warps)
        records.append(record)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", default=[],
                        help="CAPABILITY:SHAPE:DTYPE, e.g. 90:llama3-8b:bf16 (default: all)")
    parser.add_argument("--override", action="append", default=[],
                        help="KERNEL:KEY=INT replacing a launcher's choice")
    parser.add_argument("--only", metavar="KERNEL", help="compile this kernel's launches only")
    parser.add_argument("--json", action="store_true", help="one JSON record per launch")
    args = parser.parse_args()
    overrides: dict[str, dict[str, int]] = {}
    for item in args.override:
        kernel, _, assignment = item.partition(":")
        key, _, value = assignment.partition("=")
        overrides.setdefault(kernel, {})[key] = int(value)
    cases = args.case or [f"{cap}:{shape.label}:{dtype}" for cap in (90, 89, 80)
                          for shape in SHAPES for dtype in DTYPES]
    if not args.json:
        print(f"{'case':22} {'kernel':22} {'warps':>5} {'regs':>4} {'shared B':>9} {'spill B':>7}")
    for case in cases:
        for r in compile_case(case, overrides, args.only):
            if args.json:
                print(json.dumps(r), flush=True)
            elif "error" in r:
                print(f"{case:22} {r['kernel']:22} ERROR {r['error'].splitlines()[0]}")
            else:
                print(f"{case:22} {r['kernel']:22} {r['num_warps']:>5} {r['registers']:>4} "
                      f"{r['shared']:>9} {r['spills']:>7}", flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the compiler needs triton.language uninterpreted")
    main()
