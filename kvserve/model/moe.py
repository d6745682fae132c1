"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router scores every expert for each token, the
`top_k` best are kept (their softmax weights renormalised where the model says so), and each
token's output is the weighted sum of those experts' SwiGLU MLPs.

Computed grouped: for each expert that some token chose, the rows of the tokens that chose it
are gathered and run through that expert's two projections at once (one GEMM with those rows),
then added back into their tokens' rows, the experts in ascending order. A token's numbers
depend only on its own row: every expert projection is a `Linear` (or a weight-only kernel,
`quantize`) that gives a row the same numbers in a call of any size (issue 36), and the sum
runs over the token's experts in one fixed order. Knows torch and the projections; nothing
about files or attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.blocks import param
from kvserve.model.config import ModelConfig
from kvserve.model.dense import Linear, pack
from kvserve.model.quant import quantize


class MoE(nn.Module):
    """The experts' weights are two flat parameters (expert e's gate and up rows at
    [2Ie, 2I(e+1)) of `gate_up_weight`, its down rows at [He, H(e+1)) of `down_weight`), so that
    each expert's checkpoint tensors load into rows of them."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        n, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.cfg = cfg
        self.router_weight = param(n, hidden, **kw)
        self.gate_up_weight = param(n * 2 * inter, hidden, **kw)
        self.down_weight = param(n * hidden, inter, **kw)
        self.router = Linear(self.router_weight, None)
        self.gate_up: list[Any] = [Linear(self._gate_up(e), None) for e in range(n)]
        self.down: list[Any] = [Linear(self._down(e), None) for e in range(n)]
        self.row_ops: Any = None  # the row ops' SiLU (`LlamaForCausalLM.use_row_ops`)

    def _gate_up(self, e: int) -> torch.Tensor:
        rows = 2 * self.cfg.moe_intermediate_size
        return self.gate_up_weight[e * rows : (e + 1) * rows]

    def _down(self, e: int) -> torch.Tensor:
        rows = self.cfg.hidden_size
        return self.down_weight[e * rows : (e + 1) * rows]

    def linears(self) -> list[Any]:
        return [*self.gate_up, *self.down]

    def quantize(self, mode: str) -> None:
        """The experts' projections in `mode` (`kvserve.model.quant`); the router stays float.
        The flat float weights are freed where every expert holds its own form (weight-only
        codes, or oneDNN's packed copy). Experts of one shape share one lone-row probe
        (`dense.lone_row_differs`: the weight's shape decides it), not one each."""
        self.gate_up = self._experts(mode, self._gate_up)
        self.down = self._experts(mode, self._down)
        self.router = quantize("none", self.router_weight, None, dense=True)
        if all(not isinstance(lin, Linear) or lin.packed is not None for lin in self.linears()):
            for lin in self.linears():
                if isinstance(lin, Linear):
                    lin.weight = None  # its packed copy serves; the view would keep the flat weight alive
            for weight in (self.gate_up_weight, self.down_weight):
                weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def _experts(self, mode: str, weight_of: Any) -> list[Any]:
        if mode != "none":
            return [quantize(mode, weight_of(e), None, dense=True, groups=True) for e in range(self.cfg.num_experts)]
        first = quantize("none", weight_of(0), None, dense=True)
        rest = [Linear(weight_of(e), None, pack(weight_of(e)), lone_rows=False) for e in range(1, self.cfg.num_experts)]
        for lin in rest:
            lin.lone_as_pair = first.lone_as_pair
        return [first, *rest]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(cfg.experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # ascending
            tokens, slot = torch.where(chosen == e)
            gate_up = self.gate_up[e](x.index_select(0, tokens))
            if self.row_ops is not None and self.row_ops.rowwise(gate_up):
                act = self.row_ops.silu_mul(gate_up)
            else:
                gate, up = gate_up.split(cfg.moe_intermediate_size, dim=-1)
                act = F.silu(gate) * up
            out.index_add_(0, tokens, self.down[e](act) * weights[tokens, slot, None])
        return out

    def weight_slots(self, layer: str, slot: Any) -> dict[str, Any]:
        """The HF checkpoint's names of this block's tensors (`layer`: "model.layers.i."), as
        the family names them (`ModelConfig.expert_names`)."""
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        block, router, gate, up, down = self.cfg.expert_names
        slots = {f"{layer}{block}.{router}.weight": slot(self.router_weight, 0, tuple(self.router_weight.shape))}
        for e in range(self.cfg.num_experts):
            p = f"{layer}{block}.experts.{e}."
            slots[p + f"{gate}.weight"] = slot(self.gate_up_weight, 2 * inter * e, (inter, hidden))
            slots[p + f"{up}.weight"] = slot(self.gate_up_weight, 2 * inter * e + inter, (inter, hidden))
            slots[p + f"{down}.weight"] = slot(self.down_weight, hidden * e, (hidden, inter))
        return slots
