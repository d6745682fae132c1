"""The model families kvserve loads: how each differs from the Llama decoder, and the names it
goes by in a Hugging Face config.json (`model_type`) and in a GGUF file (`general.architecture`).

Every family here is the Llama decoder (`kvserve.model.llama`: RMS norms, rotary attention,
SwiGLU MLP) with some of these changes, which the config carries to the layers:
- ``qk_norm``: an RMS norm on the queries and keys before the rotary, over each head
  (``"head"``: Qwen3) or over all heads at once (``"all"``: OLMo 2);
- ``norm_after``: each sublayer's output is normalised before it joins the residual, and its
  input is not (OLMo 2);
- ``scaled``: Granite's four multipliers (embeddings, residual branches, attention scale, logits);
- ``qkv_bias``: biases on the q/k/v projections only (Qwen2);
- ``moe``: mixture-of-experts MLPs (`kvserve.model.moe`) in the layers the config names, their
  tensors under ``expert_names`` (block, router, gate, up, down: Qwen3-MoE's, or Mixtral's);
- ``fused``: the checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3),
  and the rotary may turn only part of each head (`partial_rotary_factor`);
- ``float_tail``: the norms scale by their weight, and the rotary turns, in float32 before
  rounding to the model's dtype (OLMo 2: a bf16 model then matches transformers bitwise);
- ``permuted``: llama.cpp stores its Q/K rows permuted for the rotary (the Llama converters).

Knows the families' names and traits; nothing about tensors or modules.
"""

from __future__ import annotations

from dataclasses import dataclass

QWEN_EXPERTS = ("mlp", "gate", "gate_proj", "up_proj", "down_proj")  # also what kvserve's GGUF reader names them


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    qk_norm: str = ""  # "", "head" or "all"
    norm_after: bool = False
    scaled: bool = False
    qkv_bias: bool = False
    moe: bool = False
    expert_names: tuple[str, ...] = QWEN_EXPERTS
    fused: bool = False
    float_tail: bool = False
    permuted: bool = False


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), ("llama",), permuted=True),
    Family("mistral", ("mistral",), ("mistral",), permuted=True),
    Family("qwen2", ("qwen2",), ("qwen2",), qkv_bias=True),
    Family("qwen3", ("qwen3",), ("qwen3",), qk_norm="head"),
    Family("qwen3_moe", ("qwen3_moe",), ("qwen3moe",), qk_norm="head", moe=True),
    Family("mixtral", ("mixtral",), (), moe=True, expert_names=("block_sparse_moe", "gate", "w1", "w3", "w2"),
           permuted=True),  # a GGUF of Mixtral is a `llama` with experts
    Family("phi3", ("phi3",), (), fused=True),  # llama.cpp's phi3 GGUF layout is not read
    Family("olmo2", ("olmo2",), ("olmo2",), qk_norm="all", norm_after=True, float_tail=True),
    Family("granite", ("granite",), ("granite",), scaled=True, permuted=True),
)}

HF_MODEL_TYPES = {t: f.name for f in FAMILIES.values() for t in f.hf_model_types}
GGUF_ARCHITECTURES = {a: f.name for f in FAMILIES.values() for a in f.gguf_architectures}

NOT_YET = {  # architectures people ask for that kvserve does not load yet, and what they need
    "gemma3_text": "sliding-window layers and Gemma's norms", "gemma3": "sliding-window layers and Gemma's norms",
}


def not_yet(name: object) -> str:
    """What an architecture kvserve does not load yet needs (for its error message), or ""."""
    return f" ({NOT_YET[str(name)]} are not built yet)" if str(name) in NOT_YET else ""
