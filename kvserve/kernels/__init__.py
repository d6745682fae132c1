"""Attention backends over the token-level KV pool.

`get_backend("torch")` is the fast plain-torch CPU backend (SDPA over gathered or viewed
K/V), `get_backend("reference")` the obviously-correct plain-torch test oracle;
`get_backend("triton")` runs the Triton kernels (imported lazily, so CPU-only users never
import triton).  Each exposes `attention(q, k, v, *, k_cache, v_cache, meta, sm_scale)` and
`native_decode(meta)` (a decode step's attention inputs for the CPU's one-call layers, or
None: only the torch backend's are native);
`build_step_metadata` builds the per-step `meta` (see docs/interfaces.md).

Imports only torch (and triton, lazily).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvserve.kernels.metadata import DecodeWorkspace, StepMetadata, build_step_metadata

_BACKEND_MODULES = {
    "torch": "kvserve.kernels.cpu",
    "reference": "kvserve.kernels.reference",
    "triton": "kvserve.kernels.triton_backend",
}


def get_backend(name: str) -> ModuleType:
    """Return the backend module named `name` ("torch", "reference" or "triton")."""
    try:
        module = _BACKEND_MODULES[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {sorted(_BACKEND_MODULES)}"
        ) from None
    return importlib.import_module(module)


__all__ = ["DecodeWorkspace", "StepMetadata", "build_step_metadata", "get_backend"]
