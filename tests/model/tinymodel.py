"""The tiny random model of kvserve/tools/tinymodel.py, and a paged forward for CPU tests.

`PagedKV` runs ragged steps of kvserve's model through a `kvserve.kernels` backend over
buffers laid out like memsvc's; `greedy_generate` decodes greedily with it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.tools.tinymodel import (  # noqa: F401  (re-exported for the tests)
    BYTE_VOCAB,
    CHAT_TEMPLATE,
    SPECIALS,
    VOCAB_SIZE,
    tiny_config,
    write_tiny_model,
    write_tokenizer,
)


def causal_attention(cfg: Any):
    """attend() for one sequence without a cache: causal attention over all its tokens."""
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=cfg.sm_scale)
        return o.transpose(0, 1)
    return attend


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
        fence: Any = None,
        invariant: bool = False,
    ) -> torch.Tensor:
        """Run `chunks[b]` (new tokens of request b at row rows[b], after prefix_lens[b]
        cached tokens); float32 logits of each request's last token, or of every token.
        `fence`: the model's per-layer lease check (called with the layer index)."""
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
            invariant=invariant,
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
            fence=fence,
        )


def greedy_generate(
    model: Any, backend: Any, prompts: list[list[int]], max_new: int, *, dtype: torch.dtype,
    invariant: bool = False,
) -> list[list[int]]:
    """Greedy continuation of every prompt, batched: one ragged prefill, then batched decode;
    `invariant`: the steps' attention as the runner's batch-invariant default runs it."""
    cfg = model.config
    kv = PagedKV(cfg, max_reqs=len(prompts), max_len=max(map(len, prompts)) + max_new, dtype=dtype)
    rows = list(range(len(prompts)))
    logits = kv.forward(model, backend, prompts, rows=rows, prefix_lens=[0] * len(prompts), invariant=invariant)
    out = [[int(t)] for t in logits.argmax(-1)]
    for step in range(1, max_new):
        prefix = [len(p) + step - 1 for p in prompts]
        logits = kv.forward(model, backend, [[o[-1]] for o in out], rows=rows, prefix_lens=prefix,
                            invariant=invariant)
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return out
