"""Small helpers shared by the Triton launchers: dtype mapping and interpreter detection.

Knows nothing about attention; imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def compute_dtype(kernel: object, dtype: torch.dtype) -> tl.dtype:
    """Dtype fed to tl.dot: the input dtype compiled, float32 under the interpreter.

    The interpreter evaluates bf16/fp16 arithmetic inexactly, so every operand is upcast
    after loading there; compiled kernels keep half precision for the tensor cores.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; expected float16, bfloat16 or float32")
    if isinstance(kernel, InterpretedFunction):
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(cdtype: tl.dtype) -> str:
    """Exact fp32 products for fp32 inputs (no TF32), the default for half precision."""
    return "ieee" if cdtype == tl.float32 else "tf32"


def block(n: int, minimum: int = 16) -> int:
    """Power-of-two block covering `n` (masked past it), at least `minimum` for tl.dot."""
    return max(minimum, triton.next_power_of_2(n))


def check_index(name: str, t: torch.Tensor, device: torch.device) -> None:
    """An index tensor a kernel reads: integer, on the kernel's device, unit stride last."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the kernel runs on {device}")
    if t.dim() not in (1, 2) or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name} must be 1-D or 2-D with unit stride last, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def check_step_indices(meta: object, names: tuple[str, ...], device: torch.device) -> None:
    """`check_index` of the named tensors of a step's metadata, once per step: every layer
    of the step launches with the same tensors, so the first launch's check stands for all.
    """
    key = f"checked {' '.join(names)} on {device}"
    cache = meta.backend_cache
    if key not in cache:
        for name in names:
            check_index(name, getattr(meta, name), device)
        cache[key] = True


def check_cache(name: str, cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """A cache layer must be [size, Hkv, D] with unit stride along D."""
    if cache.dim() != 3 or tuple(cache.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"{name} must be [size, {num_kv_heads}, {head_dim}], got {tuple(cache.shape)}"
        )
    if cache.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous along head_dim, strides {cache.stride()}")
