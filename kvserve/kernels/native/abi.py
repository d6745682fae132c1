"""The C kernels' side as ctypes and torch see it: the integer and pointer types, the C
function for each dtype, the structures `kvs_decode_layer` takes (csrc/decode_layer.c), and
the profiler range each call into C runs under. Knows nothing of building or loading the
library, nor of any one kernel's checks; imports only torch.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_KERNELS = {torch.bfloat16: "kvs_decode_attention_bf16", torch.float32: "kvs_decode_attention_f32"}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _traced(name: str) -> contextlib.AbstractContextManager:
    """A torch.profiler range named `name` while a profiler runs; nothing otherwise (a
    record_function costs microseconds even with no profiler, and the decode step makes
    hundreds of kernel calls)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


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
