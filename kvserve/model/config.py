"""The shape of a model of one of the families (`kvserve.model.families`): `ModelConfig`, read
from config.json or GGUF metadata.

This module knows model hyperparameters only. It never reads tensors, never builds
modules, and knows nothing about KV slots or scheduling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.model.families import (
    FAMILIES,
    GGUF_ARCHITECTURES,
    HF_MODEL_TYPES,
    QWEN_EXPERTS,
    not_yet,
)
from kvserve.model.files import gguf_context, hf_context

ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file, tensor or field at fault."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of a decoder of one of the families (Llama 2/3, Mistral, Qwen2/3, SmolLM2,
    OLMo 2, Granite)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # Per-frequency divisors (GGUF `rope_freqs.weight`, how llama.cpp stores llama3 scaling).
    rope_freq_factors: tuple[float, ...] | None = None
    qk_norm: str = ""  # the family's (`kvserve.model.families`): "", "head" or "all"
    norm_after: bool = False
    embedding_multiplier: float = 1.0  # Granite's multipliers (1.0 elsewhere)
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0  # the attention's scale; 0: head_dim ** -0.5
    logits_scaling: float = 1.0  # the logits are divided by it
    num_experts: int = 0  # mixture-of-experts layers (`kvserve.model.moe`); 0: none
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts'
    expert_names: tuple[str, ...] = QWEN_EXPERTS  # the family's (`kvserve.model.families`)
    fused_checkpoint: bool = False  # q/k/v and gate/up stored fused (Phi-3)
    rotary_dim: int = 0  # the first dims of each head the rotary turns; 0: all of head_dim
    float_tail: bool = False  # the family's (`kvserve.model.families`)

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def plain_layer(self) -> bool:
        """The Llama layer exactly (what the one-call native decode layer computes)."""
        return (not self.qk_norm and not self.norm_after and self.residual_multiplier == 1.0
                and self.embedding_multiplier == 1.0 and not self.moe_layers and self.rot_dim == self.head_dim)

    @property
    def sm_scale(self) -> float:
        return self.attention_multiplier or self.head_dim**-0.5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2 or self.rot_dim % 2 or not 0 < self.rot_dim <= self.head_dim:
            raise ModelLoadError(f"head_dim {self.head_dim} and rotary dims {self.rot_dim} must be even, the "
                                 "second at most the first")
        if self.rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
        d = self.rot_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
        inv = 1.0 / (self.rope_theta**exponents)
        if self.rope_freq_factors is not None:
            return inv / torch.tensor(self.rope_freq_factors, dtype=torch.float32)
        if self.rope_type == "linear":
            return inv / self.rope_factor
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv, self)
        return inv


def _llama3_inv_freq(inv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed, short kept, smooth in between."""
    old_len = cfg.rope_original_max_position
    low_wavelen = old_len / cfg.rope_low_freq_factor
    high_wavelen = old_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
    smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rope_fields(rope: dict[str, Any] | None, where: str) -> dict[str, Any]:
    if not rope:
        return {}
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    out: dict[str, Any] = {"rope_type": kind}
    if kind == "default":
        return out
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{where}: unsupported rope scaling type {kind!r}")
    out["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(rope["low_freq_factor"])
        out["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        out["rope_original_max_position"] = int(rope["original_max_position_embeddings"])
    return out


def config_from_hf(cfg: dict[str, Any], where: str) -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json; `where` names the file in errors."""
    model_type = cfg.get("model_type")
    family = HF_MODEL_TYPES.get(str(model_type))
    if family is None:
        archs = cfg.get("architectures")
        raise ModelLoadError(
            f"{where}: unsupported architecture model_type={model_type!r} architectures={archs!r}"
            f"{not_yet(model_type)} (supported model types: {', '.join(HF_MODEL_TYPES)})"
        )
    traits = FAMILIES[family]
    try:
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        return ModelConfig(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if family == "olmo2" else 1e-6)),  # transformers' defaults
            rope_theta=float(theta),
            max_position_embeddings=hf_context(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias or bool(cfg.get("attention_bias", False)),
            o_bias=not traits.qkv_bias and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            norm_after=traits.norm_after,
            float_tail=traits.float_tail,
            **(_multipliers(cfg) if traits.scaled else {}),
            **(_experts(cfg, family) if traits.moe else {}),
            **({"fused_checkpoint": True, "rotary_dim": _rotary_dim(cfg, rope, hidden // n_heads)} if traits.fused else {}),
            **_rope_fields(rope, where),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: missing or bad field {exc}") from None


def _rotary_dim(cfg: dict[str, Any], rope: dict[str, Any] | None, default_head: int) -> int:
    """The dims of each head the rotary turns (Phi-3's `partial_rotary_factor`, at the top of
    config.json or, as transformers 5 writes it, in `rope_parameters`)."""
    factor = cfg.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor") or 1.0
    return int(int(cfg.get("head_dim") or default_head) * float(factor))


def _experts(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """A mixture-of-experts config.json's experts (Qwen3-MoE's keys; Mixtral's experts are the
    size of its `intermediate_size`, every layer has them, their weights are renormalised)."""
    n = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])  # transformers 5 writes the latter
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    layers = tuple(i for i in range(int(cfg["num_hidden_layers"])) if i not in dense and n > 0 and (i + 1) % step == 0)
    k = int(cfg["num_experts_per_tok"])
    if layers and not 0 < k <= n:
        raise ModelLoadError(f"num_experts_per_tok {k} must be in 1..num_experts ({n})")
    mixtral = family == "mixtral"
    return {"num_experts": n, "experts_per_tok": k,
            "moe_intermediate_size": int(cfg["intermediate_size" if mixtral else "moe_intermediate_size"]),
            "norm_topk_prob": mixtral or bool(cfg.get("norm_topk_prob", False)),  # transformers' default
            "moe_layers": layers, "expert_names": FAMILIES[family].expert_names}


def _multipliers(cfg: dict[str, Any]) -> dict[str, float]:
    """Granite's multipliers from its config.json."""
    return {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),  # transformers' default
            "logits_scaling": float(cfg.get("logits_scaling", 1.0))}


def config_from_gguf(
    fields: dict[str, Any],
    where: str,
    *,
    has_output: bool,
    has_qkv_bias: bool,
    has_o_bias: bool = False,
    has_mlp_bias: bool = False,
    rope_freq_factors: tuple[float, ...] | None,
    n_tokens: int | None = None,
    moe_layers: tuple[int, ...] = (),
) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (`fields`: key -> decoded value); `n_tokens` is
    the length of the tokenizer vocabulary, used when the metadata has no vocab_size."""
    arch = fields.get("general.architecture")
    family = GGUF_ARCHITECTURES.get(str(arch))
    if family is None:
        raise ModelLoadError(
            f"{where}: unsupported GGUF architecture {arch!r}{not_yet(arch)} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    traits = FAMILIES[family]

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{where}: GGUF metadata has no {arch}.{key}")
        return value

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = fields.get(f"{arch}.vocab_size") or n_tokens
    if vocab is None:
        raise ModelLoadError(f"{where}: GGUF metadata gives no vocabulary size")
    rope_type = str(fields.get(f"{arch}.rope.scaling.type", "none"))
    rope: dict[str, Any] = {}
    if rope_type == "linear":
        rope = {"rope_type": "linear", "rope_factor": float(get("rope.scaling.factor"))}
    elif rope_type not in ("none", "default"):
        raise ModelLoadError(f"{where}: unsupported GGUF rope scaling type {rope_type!r}")
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv") or n_heads),
        head_dim=int(fields.get(f"{arch}.attention.key_length") or hidden // n_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=gguf_context(fields, str(arch)),
        tie_word_embeddings=not has_output,
        qkv_bias=has_qkv_bias,
        o_bias=has_o_bias,
        mlp_bias=has_mlp_bias,
        rope_freq_factors=rope_freq_factors,
        qk_norm=traits.qk_norm,
        norm_after=traits.norm_after,
        float_tail=traits.float_tail,
        **({"embedding_multiplier": float(fields.get(f"{arch}.embedding_scale", 1.0)),
            "residual_multiplier": float(fields.get(f"{arch}.residual_scale", 1.0)),
            "attention_multiplier": float(fields.get(f"{arch}.attention.scale", 0.0)),
            "logits_scaling": float(fields.get(f"{arch}.logit_scale", 1.0))} if traits.scaled else {}),
        **({"num_experts": int(get("expert_count")), "experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(fields.get(f"{arch}.expert_feed_forward_length")
                                         or get("feed_forward_length")),  # Mixtral's (as `llama`) is the latter
            "moe_layers": moe_layers,
            "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm", True))}  # llama.cpp's qwen3moe: on
           if moe_layers else {}),
        **rope,
    )
