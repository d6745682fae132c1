"""A whole Llama decoder layer of a small decode step in one native call
(csrc/decode_layer.c): `DecodeLayer` binds a layer's norms and 4-bit projections,
`DecodeStep` a step's positions, slots and requests, and `DecodeStep.run` applies one to
the other in place. Knows nothing of the model's modules or the backend's plans.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels.native import loader
from kvserve.kernels.native.abi import _I64, _SUFFIX, _Int4, _Layer, _Step, _traced
from kvserve.kernels.native.weights import Int4Weight


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
        if (head_dim % 2 or head_dim > loader.limits()[1] or heads % kv_heads
                or heads // kv_heads > loader.limits()[0]):
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
        self._lib = loader._load()
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
