"""Devices and dtypes: the one list of dtypes, the device check, and how "auto" resolves.

memsvc and the runners resolve "auto" with the same two functions, so that a `kvserve
serve` that hands both "auto" gets one dtype on both sides. `resolve_device` imports
torch, lazily, only for "auto"; the rest is standard library (serve and the frontend
import this module and must stay torch-free).
"""

from __future__ import annotations

from pathlib import Path

from kvserve.config import ConfigError, flag_name

DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_dtype(value: str, name: str = "dtype") -> None:
    """`value` is one of `DTYPES`."""
    if value not in DTYPES:
        raise ConfigError(f"{flag_name(name)}: {value!r} is not one of {', '.join(DTYPES)}")


def check_device(value: str, name: str = "device") -> None:
    """`value` is auto, cpu, cuda or cuda:N."""
    if not (value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())):
        raise ConfigError(f"{flag_name(name)}: {value!r} is not cpu, cuda, cuda:N or auto")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16 (native bf16 matrix math)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return bool(flags & {"amx_bf16", "avx512_bf16"})
    return False


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when a CUDA device is usable, else "cpu"; others unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> bfloat16 on CUDA or on CPUs with native bf16, else float32 (`device` resolved)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"
