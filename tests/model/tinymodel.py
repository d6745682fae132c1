"""Write a tiny random Llama-family model as a Hugging Face directory, for fast CPU tests.

`write_tiny_model(dir)` saves config.json, safetensors weights (sharded on request, with
`model.safetensors.index.json`), a byte-level tokenizer with a chat template, and a
generation_config.json. The weights come from transformers' own model classes, so the
directory is exactly what a real checkpoint looks like, and the same directory can be
loaded back by transformers as the reference.
"""

from __future__ import annotations

import json
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
) -> Any:
    """A transformers config for a tiny model of `family` ("llama", "mistral", "qwen2")."""
    from transformers import AutoConfig

    kw: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
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
    if family == "mistral":
        kw["sliding_window"] = None
    return AutoConfig.for_model(family, **kw)


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


class PagedKV:
    """KV buffers and a `req_to_token` table allocated in-process, laid out like memsvc's.

    Row r owns slots 1 + r * max_len ... (slot 0 stays the dummy slot). `forward` runs one
    ragged step of the model through a `kvserve.kernels` backend, as the runner does.
    """

    def __init__(self, config: Any, *, max_reqs: int, max_len: int, dtype: torch.dtype) -> None:
        shape = (config.num_layers, max_reqs * max_len + 1, config.num_kv_heads, config.head_dim)
        self.config = config
        self.k_buffer = torch.zeros(shape, dtype=dtype)
        self.v_buffer = torch.zeros(shape, dtype=dtype)
        slots = torch.arange(max_reqs * max_len, dtype=torch.int32) + 1
        self.req_to_token = slots.view(max_reqs, max_len)

    def forward(
        self,
        model: Any,
        backend: Any,
        chunks: list[list[int]],
        *,
        rows: list[int],
        prefix_lens: list[int],
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run `chunks[b]` (new tokens of request b at row rows[b], after prefix_lens[b]
        cached tokens); float32 logits of each request's last token, or of every token."""
        from kvserve.kernels import build_step_metadata

        meta = build_step_metadata(
            req_to_token=self.req_to_token,
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=[len(c) for c in chunks],
            num_q_heads=self.config.num_heads,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            device="cpu",
        )
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        if all_logits:
            idx = torch.arange(ids.numel())
        else:
            idx = torch.cumsum(torch.tensor([len(c) for c in chunks]), 0) - 1
        return model(
            ids,
            meta,
            k_buffer=self.k_buffer,
            v_buffer=self.v_buffer,
            backend=backend,
            logits_indices=idx,
        )


def greedy_generate(
    model: Any, backend: Any, prompts: list[list[int]], max_new: int, *, dtype: torch.dtype
) -> list[list[int]]:
    """Greedy continuation of every prompt, batched: one ragged prefill, then batched decode."""
    cfg = model.config
    kv = PagedKV(cfg, max_reqs=len(prompts), max_len=max(map(len, prompts)) + max_new, dtype=dtype)
    rows = list(range(len(prompts)))
    logits = kv.forward(model, backend, prompts, rows=rows, prefix_lens=[0] * len(prompts))
    out = [[int(t)] for t in logits.argmax(-1)]
    for step in range(1, max_new):
        prefix = [len(p) + step - 1 for p in prompts]
        logits = kv.forward(model, backend, [[o[-1]] for o in out], rows=rows, prefix_lens=prefix)
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return out
