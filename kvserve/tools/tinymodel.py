"""Write a tiny random Llama-family model as a Hugging Face directory (tests, the GPU check).

`write_tiny_model(dir)` saves config.json, safetensors weights (sharded on request, with
`model.safetensors.index.json`), a byte-level tokenizer with a chat template, and a
generation_config.json. The weights come from transformers' own model classes, so the
directory is exactly what a real checkpoint looks like, and the same directory can be
loaded back by transformers as the reference. `write_random_llama(dir, shape)` writes a
large one (Llama-3.1-8B's shape, say) straight from torch's generator, layer by layer,
with a word-level tokenizer covering the whole vocabulary (prompts travel as token ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BYTE_VOCAB = 256
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
VOCAB_SIZE = BYTE_VOCAB + len(SPECIALS) + 5  # a few unused rows, like real checkpoints
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte) plus special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for name in SPECIALS:
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[2]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def tiny_config(
    *,
    family: str = "llama",
    tie: bool = True,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_layers: int = 2,
    rope_scaling: dict[str, Any] | None = None,
    attention_bias: bool = False,
    hidden_size: int = 48,
    intermediate_size: int = 80,
    max_positions: int = 512,
    extra: dict[str, Any] | None = None,
) -> Any:
    """A transformers config for a tiny model of `family` (a transformers model_type: "llama",
    "mistral", "qwen2", "qwen3", "olmo2", "granite"); `extra`: more config fields."""
    from transformers import AutoConfig

    kw: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie,
        "bos_token_id": BYTE_VOCAB,
        "eos_token_id": BYTE_VOCAB + 1,
        "pad_token_id": BYTE_VOCAB + 2,
    }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": 500000.0}
    kw["rope_parameters"] = rope
    if family == "llama":
        kw["attention_bias"] = attention_bias
    if family in ("mistral", "qwen3"):
        kw["sliding_window"] = None
    return AutoConfig.for_model(family, **kw | (extra or {}))


def write_tiny_model(path: Path, *, seed: int = 0, shard: bool = False, **config_kw: Any) -> Path:
    """Write a random tiny model of `tiny_config(**config_kw)` to `path`; returns `path`."""
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # HF init makes norms exactly 1 and biases 0: perturb them
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path), max_shard_size="40KB" if shard else "2GB")
    write_tokenizer(path)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BYTE_VOCAB, "eos_token_id": [BYTE_VOCAB + 1]})
    )
    return path


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The numbers of a Llama checkpoint that size its weights (`family` "qwen3" adds its q/k
    norms; "qwen3_moe" also `experts` MLPs of `expert_intermediate` rows, `experts_per_tok`)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 128
    rope_theta: float = 500000.0
    max_positions: int = 8192
    family: str = "llama"
    experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate: int = 0


LLAMA_3_1_8B = LlamaShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                          vocab=128256)
QWEN3_0_6B = LlamaShape(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, vocab=151936,
                        rope_theta=1000000.0, family="qwen3")
QWEN3_30B_A3B_4_LAYERS = LlamaShape(hidden=2048, intermediate=6144, layers=4, heads=32, kv_heads=4, vocab=151936,
                                    rope_theta=1000000.0, family="qwen3_moe", experts=128, experts_per_tok=8,
                                    expert_intermediate=768)  # Qwen3-30B-A3B's layers, 4 of its 48


def write_random_llama(path: Path, shape: LlamaShape, *, dtype: torch.dtype = torch.bfloat16,
                       device: str = "cpu", seed: int = 0, std: float = 0.02) -> Path:
    """Random weights of `shape` as an HF Llama directory, one safetensors shard per layer
    (made on `device`, written from host memory); returns `path`."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        t = torch.empty(size, dtype=dtype, device=device)
        return t.normal_(0.0, std, generator=gen).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    h, d = shape.hidden, shape.head_dim
    shards: list[dict[str, torch.Tensor]] = [{
        "model.embed_tokens.weight": rand(shape.vocab, h),
        "model.norm.weight": ones(h),
        "lm_head.weight": rand(shape.vocab, h),
    }]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        shards.append({
            p + "self_attn.q_proj.weight": rand(shape.heads * d, h),
            p + "self_attn.k_proj.weight": rand(shape.kv_heads * d, h),
            p + "self_attn.v_proj.weight": rand(shape.kv_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, shape.heads * d),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        })
        if shape.family != "llama":
            shards[-1] |= {p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d)}
        mlps = [(f"{p}mlp.experts.{e}.", shape.expert_intermediate) for e in range(shape.experts)] or \
            [(p + "mlp.", shape.intermediate)]
        if shape.experts:
            shards[-1][p + "mlp.gate.weight"] = rand(shape.experts, h)
        for q, inter in mlps:
            shards[-1] |= {q + "gate_proj.weight": rand(inter, h), q + "up_proj.weight": rand(inter, h),
                           q + "down_proj.weight": rand(h, inter)}
    weight_map: dict[str, str] = {}
    total = 0
    for n, tensors in enumerate(shards):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    eos = shape.vocab - 1
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    moe = {"num_experts": shape.experts, "num_experts_per_tok": shape.experts_per_tok, "norm_topk_prob": True,
           "moe_intermediate_size": shape.expert_intermediate} if shape.experts else {}
    (path / "config.json").write_text(json.dumps(moe | {
        "architectures": [arch[shape.family]], "model_type": shape.family,
        "hidden_size": h, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": d, "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": 0, "eos_token_id": eos,
    }))
    vocab = {f"<{i}>": i for i in range(shape.vocab)}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a text prompt is a token a word
    word_level.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"<{eos}>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path
