"""The decoder's building blocks that hold no projection: the RMS norm and the rotary
embedding's tables and rotation (the HF rotate-half layout), each with torch's numbers or
through the row ops (`LlamaForCausalLM.use_row_ops`) with the same. Knows torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvserve.model.config import ModelConfig

# rope(x [T, >= heads * D], heads) -> the first `heads` heads rotated, [T, heads, D]
RopeFn = Callable[[torch.Tensor, int], torch.Tensor]


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An empty parameter without grad, for `weights.py` to fill."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, as transformers does, then scaled in the model dtype
    (`float_scale`: scaled in float32 and then rounded, as OLMo 2 does; torch's ops only)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device,
                 float_scale: bool = False) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype, device=device)
        self.eps = eps
        self.float_scale = float_scale
        self.row_ops: Any = None  # set by LlamaForCausalLM.use_row_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.row_ops
        if ops is not None and not self.float_scale and ops.rowwise(x):
            return ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float_scale:
            return (self.weight * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables [positions, rotary dims // 2] computed once in float32, grown on demand;
    where the rotary turns only the first dims of each head (`ModelConfig.rotary_dim`), the
    rest pass unchanged (on torch's ops)."""

    def __init__(self, config: ModelConfig, *, device: torch.device) -> None:
        super().__init__()
        self.head_dim, self.partial = config.head_dim, config.rot_dim < config.head_dim
        self.float_turn = config.float_tail  # turned in float32, then rounded (OLMo 2)
        self.register_buffer("inv_freq", config.inv_freq().to(device), persistent=False)
        self.register_buffer(
            "cos", torch.empty(0, config.rot_dim // 2, device=device), persistent=False
        )
        self.register_buffer(
            "sin", torch.empty(0, config.rot_dim // 2, device=device), persistent=False
        )
        self._grow(min(config.max_position_embeddings, 8192))

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def _ensure(self, positions: torch.Tensor) -> None:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0]))

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` [T], shaped [T, 1, D/2] in `dtype`."""
        self._ensure(positions)
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, ops: Any = None) -> RopeFn:
        """The rotation of one step's tokens at `positions` [T]: f(x [T, >= heads * D] with
        contiguous rows, heads) -> the first `heads` heads rotated, [T, heads, D]. With
        `ops` (row ops, see `LlamaForCausalLM.use_row_ops`), one pass of its `rotary` (the
        same numbers)."""
        if self.float_turn or self.partial:  # torch's ops: the first `rot` dims, in float32 if asked
            turn_dtype = torch.float32 if self.float_turn else dtype
            cos, sin = self.tables(positions, turn_dtype)
            rot, d = 2 * self.cos.shape[1], self.head_dim

            def turn(x: torch.Tensor, heads: int) -> torch.Tensor:
                x = x[:, : heads * d].reshape(x.shape[0], heads, d)
                turned = apply_rotary(x[..., :rot].to(turn_dtype), cos, sin).to(x.dtype)
                return turned if rot == d else torch.cat((turned, x[..., rot:]), dim=-1)
            return turn
        if ops is not None:
            self._ensure(positions)
            pos = positions.to(torch.int64).contiguous()
            cos_t, sin_t = self.cos, self.sin
            return lambda x, heads: ops.rotary(x, heads, cos_t, sin_t, pos)
        cos, sin = self.tables(positions, dtype)
        d = 2 * self.cos.shape[1]
        return lambda x, heads: apply_rotary(x.view(x.shape[0], heads, d), cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of the last dim (the HF "rotate_half" layout): x [T, H, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
