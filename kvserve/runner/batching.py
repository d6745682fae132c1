"""Turn one step's plan (which requests compute how many tokens) into model inputs.

`ForwardBatch.build` concatenates the new tokens of every planned request into one flat
ragged batch (request by request, as the kernels expect), builds the step's `StepMetadata`
metadata with `kvserve.kernels.build_step_metadata` once, and records which flat positions need
logits (the last token of every request that samples this step). It knows nothing about
memsvc messages, sampling parameters or sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.kernels import DecodeWorkspace, build_step_metadata
from kvserve.runner.requests import Request


@dataclass(slots=True)
class ForwardBatch:
    """Inputs of one forward pass."""

    input_ids: torch.Tensor  # [T] int64 on the model's device
    meta: Any  # kvserve.kernels.StepMetadata
    logits_indices: torch.Tensor  # [S] int64: flat index of each sampling request's last token
    sampling: list[Request]  # the S requests that sample, in logits order
    num_tokens: int
    is_decode: bool

    @classmethod
    def build(
        cls,
        plan: Sequence[tuple[Request, int]],
        *,
        req_to_token: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        workspace: DecodeWorkspace | None,
        invariant: bool = False,
    ) -> ForwardBatch:
        """`plan` holds (request, number of new tokens) pairs, each n >= 1; `invariant`: the
        step's attention batch-invariant (`StepMetadata.invariant`)."""
        ids: list[int] = []
        rows: list[int] = []
        prefix: list[int] = []
        extend: list[int] = []
        last: list[int] = []
        sampling: list[Request] = []
        for req, n in plan:
            start = req.computed
            if n == 1:
                ids.append(req.tokens[start])
            else:
                ids.extend(req.tokens[start : start + n])
            rows.append(req.row)
            prefix.append(start)
            extend.append(n)
            if start + n == len(req.tokens):
                last.append(len(ids) - 1)
                sampling.append(req)
        meta = build_step_metadata(
            req_to_token=req_to_token,
            req_pool_indices=rows,
            prefix_lens=prefix,
            extend_lens=extend,
            num_q_heads=num_q_heads,
            head_dim=head_dim,
            device=device,
            workspace=workspace,
            num_kv_heads=num_kv_heads,
            invariant=invariant,
        )
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True),
            meta=meta,
            logits_indices=torch.tensor(last, dtype=torch.int64).to(device, non_blocking=True),
            sampling=sampling,
            num_tokens=len(ids),
            is_decode=len(ids) == len(rows),
        )
