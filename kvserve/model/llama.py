"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2, OLMo 2, Granite: the traits
of each in `kvserve.model.families`) over a flat ragged batch.

Tokens of all requests are concatenated (no padding); each carries its absolute position.
Attention is delegated: `forward` hands each layer's q/k/v to a `kvserve.kernels` backend
with the memsvc-mapped KV buffers; `forward_tokens` takes any `attend` callable (the
static benchmark loop uses a dense cache). A small decode step may instead run each layer
in one call of the row ops (`DecodeStep`), given the step's slots and rows as the backend
hands them over (`backend.native_decode`): this module passes them through, and knows
nothing else about slots, nor about requests, scheduling or sampling, and nothing about
file formats: `weights.py` fills the parameters through `weight_slots()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.blocks import RMSNorm, RopeFn, Rotary, param
from kvserve.model.config import ModelConfig
from kvserve.model.dense import Linear
from kvserve.model.moe import MoE
from kvserve.model.quant import (
    HEAD_DENSE_ROWS,
    HEAD_FLOAT_DENSE_ROWS,
    NATIVE_HEAD_FLOAT_DENSE_ROWS,
    Int4Linear,
    Int8Linear,
    quantize,
)

PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""A DecoderLayer's projections (attributes holding a `quant` Linear or weight-only kernel)."""

# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one checkpoint tensor goes: rows [start, start + shape[0]) of `param`."""

    param: torch.Tensor
    start: int
    shape: tuple[int, ...]


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with fused qkv and gate/up projections; with the config's
    q/k norms, norms after the sublayers (`norm_after`: `post_norm` then normalises the
    attention's output, `ffn_norm` the MLP's) and residual multiplier."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device, moe: bool = False) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.cfg = cfg
        self.moe = MoE(cfg, **kw) if moe else None  # the experts replace the MLP's projections
        nkw: dict[str, Any] = {**kw, "float_scale": cfg.float_tail}
        self.input_norm = None if cfg.norm_after else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **nkw)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **nkw)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **nkw) if cfg.norm_after else None
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else cfg.q_size, cfg.rms_norm_eps, **nkw)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else cfg.kv_size, cfg.rms_norm_eps, **nkw)
        qkv_rows = cfg.q_size + 2 * cfg.kv_size
        self.qkv_weight = param(qkv_rows, cfg.hidden_size, **kw)
        self.qkv_bias = param(qkv_rows, **kw) if cfg.qkv_bias else None
        self.o_weight = param(cfg.hidden_size, cfg.q_size, **kw)
        self.o_bias = param(cfg.hidden_size, **kw) if cfg.o_bias else None
        inter = 0 if moe else cfg.intermediate_size
        self.gate_up_weight = param(2 * inter, cfg.hidden_size, **kw)
        self.gate_up_bias = param(2 * inter, **kw) if cfg.mlp_bias and not moe else None
        self.down_weight = param(cfg.hidden_size, inter, **kw)
        self.down_bias = param(cfg.hidden_size, **kw) if cfg.mlp_bias and not moe else None
        self.qkv = Linear(self.qkv_weight, self.qkv_bias)
        self.o = Linear(self.o_weight, self.o_bias)
        self.gate_up = Linear(self.gate_up_weight, self.gate_up_bias)
        self.down = Linear(self.down_weight, self.down_bias)
        self.fused: Any = None  # the whole layer in one native call (`LlamaForCausalLM.use_row_ops`)
        self.row_ops: Any = None  # the SiLU's, where the row ops have one (`use_row_ops`)

    def quantize(self, mode: str) -> None:
        """Swap the four projections for `mode`'s (`kvserve.model.quant`), each with a dense copy
        of its quantized weight for large batches; frees the float weights."""
        if self.moe is not None:
            self.moe.quantize(mode)
        for name in self.projections():
            weight = getattr(self, f"{name}_weight")
            lin = quantize(mode, weight, getattr(self, f"{name}_bias"), dense=True, groups=True)
            setattr(self, name, lin)
            if mode != "none" or getattr(lin, "packed", None) is not None:
                weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def projections(self) -> tuple[str, ...]:
        """The names of the projections this layer holds (the experts hold the MLP's)."""
        return PROJECTIONS[:2] if self.moe is not None else PROJECTIONS

    def linears(self) -> list[Any]:
        """Every projection of the layer, the experts' included."""
        return [getattr(self, n) for n in self.projections()] + (self.moe.linears() if self.moe is not None else [])

    def forward(
        self, x: torch.Tensor, rope: RopeFn, layer: int, attend: AttendFn
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv(x if self.input_norm is None else self.input_norm(x))
        n_qk = cfg.num_heads + cfg.num_kv_heads
        qk = qkv[:, : n_qk * cfg.head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            shape = (-1, cfg.head_dim) if cfg.qk_norm == "head" else (t, -1)  # each head's row, or each token's
            q = self.q_norm(qkv[:, : cfg.q_size].reshape(shape).contiguous()).reshape(t, -1)
            k = self.k_norm(qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].reshape(shape).contiguous()).reshape(t, -1)
            qk = torch.cat((q, k), dim=1)
        qk = rope(qk, n_qk)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, n_qk * cfg.head_dim :].view(t, cfg.num_kv_heads, cfg.head_dim)
        o = attend(layer, q, k, v)
        h = x + self._residual(self.o(o.reshape(t, cfg.q_size)), self.post_norm if cfg.norm_after else None)
        if self.moe is not None:
            return h + self._residual(self.moe(self.post_norm(h)), self.ffn_norm)
        gate_up = self.gate_up(h if cfg.norm_after else self.post_norm(h))
        if self.row_ops is not None and self.row_ops.rowwise(gate_up):  # the one-call layer's SiLU
            return h + self._residual(self.down(self.row_ops.silu_mul(gate_up)), self.ffn_norm)
        gate, up = gate_up.split(cfg.intermediate_size, dim=-1)
        return h + self._residual(self.down(F.silu(gate) * up), self.ffn_norm)

    def _residual(self, branch: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream."""
        if norm is not None:
            return norm(branch)
        m = self.cfg.residual_multiplier
        return branch if m == 1.0 else branch * m


def _one_kernel(lin: Any, batch_invariant: bool) -> None:
    """`lin` as `LlamaForCausalLM.use_row_ops` leaves it for `batch_invariant`."""
    if isinstance(lin, Linear):
        lin.lone_as_pair = lin.lone_as_pair and batch_invariant
    elif batch_invariant:
        lin.dense = None  # one kernel for every batch size: the dense copy's numbers are other ones


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose parameters are allocated empty; load them with weights.py."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed = param(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(config, **kw, moe=i in config.moe_layers)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw, float_scale=config.float_tail)
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings
            else param(config.vocab_size, config.hidden_size, **kw)
        )
        self.rotary = Rotary(config, device=device)
        self.sm_scale = config.sm_scale
        self.head = Linear(self.lm_head, None)
        self.quantization = "none"
        self.row_ops: Any = None
        self.fused_rows: float = 0  # decode steps of up to this many rows run each layer in one native call

    def use_row_ops(self, ops: Any, *, batch_invariant: bool = True) -> None:
        """Run the RMS norms and the rotary embedding through `ops` where `ops.rowwise(x)`
        holds: an object with `rowwise(x) -> bool`, `rms_norm(x, weight, eps)` and
        `rotary(x, heads, cos_table, sin_table, positions)` giving these modules' numbers
        (the runner passes `kvserve.kernels.native`; this package imports no kernels). None:
        torch's ops. The int4 projections take `ops.Int4Weight` where the ops have one and
        `ops.int4_available()` (`quant.Int4Linear.use_ops`: a choice made once), the int8
        projections and head `ops.Int8Weight` where `ops.int8_available()`
        (`quant.Int8Linear.use_ops`), the head with its own switch to the dense copy.

        `batch_invariant` (the runner's default, issue 36): a row's numbers do not depend on
        the step it is in. Each weight-only projection and the head keep one kernel for every
        batch size (their dense copies, another reduction on other activations, are freed),
        the separate calls take the one-call layer's SiLU, and a float projection runs a lone
        row as two where its GEMM would give it other bits (`dense.lone_row_differs`). False:
        the switches to the dense copies above their rows, and a lone row as one."""
        self.row_ops = ops
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.row_ops = ops
        if isinstance(self.head, Int8Linear) and self.head.kernel is None:
            self.head.use_ops(ops if hasattr(ops, "Int8Weight") else None)
            if self.head.kernel is not None:  # the head's own switch, not the projections'
                self.head.dense_rows = HEAD_DENSE_ROWS if self.head.dense_packed else NATIVE_HEAD_FLOAT_DENSE_ROWS
        _one_kernel(self.head, batch_invariant)
        int4 = ops if hasattr(ops, "Int4Weight") else None
        int8 = ops if hasattr(ops, "Int8Weight") else None
        for layer in self.layers:
            lins = layer.linears()
            for lin in lins:
                if isinstance(lin, Int4Linear):
                    lin.use_ops(int4)
                elif isinstance(lin, Int8Linear):
                    lin.use_ops(int8)
            layer.fused = None
            layer.row_ops = ops if hasattr(ops, "silu_mul") else None
            if layer.moe is not None:
                layer.moe.row_ops = layer.row_ops
                _one_kernel(layer.moe.router, batch_invariant)
            for lin in lins:
                _one_kernel(lin, batch_invariant)
            if int4 is not None and hasattr(ops, "DecodeLayer") and self.config.plain_layer and all(
                    isinstance(lin, Int4Linear) and lin.kernel is not None and lin.bias is None for lin in lins):
                cfg = self.config
                try:
                    layer.fused = ops.DecodeLayer(
                        layer.input_norm.weight, layer.post_norm.weight, cfg.rms_norm_eps,
                        *(lin.kernel for lin in lins), heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim)
                except ValueError:  # a dtype or head shape the one-call layer does not take
                    layer.fused = None
        fused = all(layer.fused is not None for layer in self.layers)
        self.fused_rows = min(lin.kernel_rows for layer in self.layers for lin in layer.linears()) \
            if fused and self.layers else 0

    def quantize(self, mode: str) -> None:
        """Weight-only quantization of the loaded model (`kvserve.model.quant`): the layers'
        projections in `mode`, the output head int8 unless `mode` is "none". Float weights
        that `dense.pack` packs for oneDNN keep only their packed form (the head's, when
        tied to the embedding, both)."""
        for layer in self.layers:
            layer.quantize(mode)
        if mode != "none":
            self.head = quantize("int8", self.lm_head, None, dense=True, groups=True)
            self.head.dense_rows = HEAD_DENSE_ROWS if self.head.dense_packed else HEAD_FLOAT_DENSE_ROWS
            if self.lm_head is not self.embed:
                self.lm_head.data = torch.empty(0, dtype=self.dtype, device=self.device)
        else:
            self.head = quantize("none", self.lm_head, None, dense=True)
        self.quantization = mode

    def _fused_step(self, input_ids: torch.Tensor, meta: Any, k_buffer: torch.Tensor, backend: Any) -> Any:
        """The row ops' `DecodeStep` for a step that every layer can take in one native call
        (`DecoderLayer.fused`: a decode step of at most `fused_rows` requests whose attention
        the backend runs natively in place, `backend.native_decode`), else None."""
        tokens = input_ids.shape[0]
        if not 0 < tokens <= self.fused_rows or k_buffer.dtype != self.dtype:
            return None
        native_decode = getattr(backend, "native_decode", None)  # the kernels' backends have it
        attention = native_decode(meta) if native_decode is not None else None
        if attention is None:
            return None
        req_to_token, rows, lens = attention
        cfg = self.config
        self.rotary._ensure(meta.positions)
        return self.row_ops.DecodeStep(
            (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size),
            positions=meta.positions, loc=meta.out_cache_loc, req_to_token=req_to_token, rows=rows, lens=lens,
            cos=self.rotary.cos, sin=self.rotary.sin, sm_scale=self.sm_scale, pool_size=k_buffer.shape[1])

    def weight_slots(self) -> dict[str, WeightSlot]:
        """Every tensor a HF-named checkpoint must supply, keyed by its HF name."""
        cfg = self.config
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": WeightSlot(self.embed, 0, tuple(self.embed.shape))
        }
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = WeightSlot(self.lm_head, 0, tuple(self.lm_head.shape))
        slots["model.norm.weight"] = WeightSlot(self.norm.weight, 0, (cfg.hidden_size,))
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            if layer.input_norm is not None:
                slots[p + "input_layernorm.weight"] = WeightSlot(layer.input_norm.weight, 0, (h,))
            slots[p + "post_attention_layernorm.weight"] = WeightSlot(
                layer.post_norm.weight, 0, (h,)
            )
            if layer.ffn_norm is not None:
                slots[p + "post_feedforward_layernorm.weight"] = WeightSlot(layer.ffn_norm.weight, 0, (h,))
            for norm, name in ((layer.q_norm, "q_norm"), (layer.k_norm, "k_norm")):
                if norm is not None:
                    slots[p + f"self_attn.{name}.weight"] = WeightSlot(norm.weight, 0, tuple(norm.weight.shape))
            fused = (("qkv_proj", 0, q + 2 * kv),) if cfg.fused_checkpoint else ()  # Phi-3's
            for name, start, rows in fused or (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                slots[p + f"self_attn.{name}.weight"] = WeightSlot(
                    layer.qkv_weight, start, (rows, h)
                )
                if layer.qkv_bias is not None:
                    slots[p + f"self_attn.{name}.bias"] = WeightSlot(layer.qkv_bias, start, (rows,))
            slots[p + "self_attn.o_proj.weight"] = WeightSlot(layer.o_weight, 0, (h, q))
            if layer.o_bias is not None:
                slots[p + "self_attn.o_proj.bias"] = WeightSlot(layer.o_bias, 0, (h,))
            if layer.moe is not None:
                slots.update(layer.moe.weight_slots(p, WeightSlot))
                continue
            for name, start, rows in (("gate_up_proj", 0, 2 * inter),) if cfg.fused_checkpoint else (
                    ("gate_proj", 0, inter), ("up_proj", inter, inter)):
                slots[p + f"mlp.{name}.weight"] = WeightSlot(layer.gate_up_weight, start, (rows, h))
                if layer.gate_up_bias is not None:
                    slots[p + f"mlp.{name}.bias"] = WeightSlot(layer.gate_up_bias, start, (rows,))
            slots[p + "mlp.down_proj.weight"] = WeightSlot(layer.down_weight, 0, (h, inter))
            if layer.down_bias is not None:
                slots[p + "mlp.down_proj.bias"] = WeightSlot(layer.down_bias, 0, (h,))
        return slots

    @torch.inference_mode()
    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        logits_indices: torch.Tensor,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """Run the flat batch `input_ids` [T] at `positions` [T]; logits [B, vocab] for the
        tokens at `logits_indices` [B]: float32, or with `float_logits` False the head's own
        dtype (the model's)."""
        x = self._embed(input_ids)
        ops = self.row_ops
        rope = self.rotary.rope(positions, self.dtype, ops if ops is not None and ops.rowwise(x) else None)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, i, attend)
        return self._logits(x, logits_indices, float_logits)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor, float_logits: bool) -> torch.Tensor:
        logits = self.head(self.norm(x.index_select(0, logits_indices)))
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits.float() if float_logits else logits

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: Any,
        *,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        backend: Any,
        logits_indices: torch.Tensor,
        fence: Callable[[int], None] | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """Forward over memsvc KV buffers [n_layers, size, Hkv, D] with a kernels backend.

        `meta` is a `kvserve.kernels.StepMetadata` (its `positions` are the absolute positions of
        `input_ids`); each layer's new k/v are stored at `meta.out_cache_loc` by the backend, or
        by the one-call layer (`_fused_step`) that takes a small decode step.
        `fence`, when given, is called with the layer index right before each layer's store and
        raises to stop the forward (the runner's lease check). Returns logits [B, vocab] for `logits_indices`:
        float32, or with `float_logits` False the head's own dtype (the model's).
        """
        scale = self.sm_scale
        step = self._fused_step(input_ids, meta, k_buffer, backend)
        if step is not None:
            x = self._embed(input_ids)
            for i, layer in enumerate(self.layers):
                if fence is not None:
                    fence(i)
                step.run(layer.fused, x, k_buffer[i], v_buffer[i])
            return self._logits(x, logits_indices, float_logits)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if fence is not None:
                fence(layer)
            return backend.attention(
                q, k, v, k_cache=k_buffer[layer], v_cache=v_buffer[layer], meta=meta, sm_scale=scale
            )

        return self.forward_tokens(input_ids, meta.positions, attend, logits_indices, float_logits)
