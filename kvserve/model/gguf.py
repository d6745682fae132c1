"""Reading a `.gguf` file: metadata, HF-named dequantized tensors, and a cached tokenizer.

llama.cpp stores weights under its own names and, for the llama architecture, permutes the
rows of the Q and K projections so that rotary pairs are interleaved; this module renames
the tensors to the Hugging Face names and undoes that permutation, so that the model code
sees exactly what a HF checkpoint holds. It knows nothing about modules or devices.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.model import tokenizer_cache
from kvserve.model.config import ModelConfig, ModelLoadError, config_from_gguf
from kvserve.model.families import FAMILIES
from kvserve.model.files import ModelFileError, open_gguf, reader_fields

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, OLMo 2
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # OLMo 2 (which has no ffn_norm)
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts router
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
"""llama.cpp's experts of a layer, one 3-D tensor [experts, rows, cols] per projection."""
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_reader(path: Path) -> Any:
    """The GGUF reader of `path`; ModelLoadError when it is missing or unreadable."""
    if not path.is_file():
        raise ModelLoadError(f"model {path}: no such file")
    try:
        return open_gguf(path)
    except ModelFileError as exc:
        raise ModelLoadError(str(exc)) from None


read_fields = reader_fields
"""Decoded metadata of a reader (the one header reader, `kvserve.model.files`)."""


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name for a GGUF tensor name, or None when it has no HF counterpart."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (interleaved pairs -> two halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    fields = read_fields(reader)
    names = {t.name for t in reader.tensors}
    factors = None
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = tuple(float(x) for x in _dequantize(t).reshape(-1))
    return config_from_gguf(
        fields,
        str(path),
        has_output="output.weight" in names,
        has_qkv_bias="blk.0.attn_q.bias" in names,
        has_o_bias="blk.0.attn_output.bias" in names,
        has_mlp_bias="blk.0.ffn_up.bias" in names or "blk.0.ffn_down.bias" in names,
        rope_freq_factors=factors,
        n_tokens=fields.get("tokenizer.ggml.tokens#len"),
        moe_layers=tuple(sorted(int(n.split(".")[1]) for n in names if n.endswith(".ffn_gate_inp.weight"))),
    )


def _dequantize(t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    arr = dequantize(t.data, t.tensor_type)
    return arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))


def _checked_dequantize(t: Any, path: Path) -> np.ndarray:
    try:
        return _dequantize(t)
    except Exception as exc:
        raise ModelLoadError(f"model {path}: tensor {t.name}: cannot dequantize ({exc})") from None


def iter_tensors(
    reader: Any, config: ModelConfig, path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor with a HF counterpart."""
    permute = FAMILIES[config.family].permuted  # llama.cpp's Llama converters permute Q/K rows
    for t in reader.tensors:
        name = hf_name(t.name)
        m = _BLOCK_RE.match(t.name)
        if name is None and m is not None and m.group(2) in _EXPERT_NAMES:
            experts = _checked_dequantize(t, path)
            for e in range(experts.shape[0]):
                hf = f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERT_NAMES[m.group(2)]}.{m.group(3)}"
                yield hf, torch.from_numpy(np.array(experts[e], dtype=np.float32, order="C"))
            continue
        if name is None and m is not None and m.group(2) != "attn_rot_embd":  # (llama.cpp's old rotary cache)
            raise ModelLoadError(f"model {path}: tensor {t.name}: a layer tensor kvserve does not know ({m.group(2)}); "
                                 "it would be left out")
        if name is None:
            continue
        arr = _checked_dequantize(t, path)
        if permute and ".q_proj." in name:
            arr = _unpermute(arr, config.num_heads)
        elif permute and ".k_proj." in name:
            arr = _unpermute(arr, config.num_kv_heads)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))


_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                *_EXPERT_NAMES)


def projection_types(reader: Any) -> dict[str, int]:
    """{GGML type name: tensors} over the layers' projection weights (Q4_1, Q8_0, F16, ...)."""
    out: dict[str, int] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PROJECTIONS and parts[3] == "weight":
            name = t.tensor_type.name
            out[name] = out.get(name, 0) + 1
    return out


def cached_tokenizer(path: Path, cache_root: Path) -> Any:
    """The transformers tokenizer of a GGUF file, from the tokenizer.json directory that
    `kvserve.model.tokenizer_cache` builds once per file (the frontend reads the same one)."""
    from transformers import AutoTokenizer

    try:
        target = tokenizer_cache.build(path, cache_root)
    except ModelFileError as exc:
        raise ModelLoadError(str(exc)) from None
    return AutoTokenizer.from_pretrained(str(target))
