"""What the runner checks of a `GenerateReq`'s sampling parameters before it queues one: the
frontend link is a socket, so a buggy or hostile peer can send anything that decodes, and a
bad field fails the request with an error naming it. Also the output of a request that fails
before it produced anything. Knows the link's messages; nothing about scheduling.
"""

from __future__ import annotations

import math

from kvserve.messages.frontend_runner import ErrorCode, FinishReason, SamplingParams, TokenOut
from kvserve.runner.sampling import SEED_RANGE

MAX_WAITING = 4096
"""Requests one runner queues; more fail at once (the frontend bounds them well below)."""
MAX_LOGPROBS = 20
"""Top-n logprobs a request may ask for (the frontend's cap, `validation.MAX_LOGPROBS`)."""
MAX_STOP_TOKEN_IDS = 4096
"""Stop token ids one request may carry (above the frontend's default max_stop_token_ids, 256)."""
MAX_NEW_TOKENS = (1 << 63) - 1
"""The largest max_new_tokens taken (the context length ends a request long before)."""
MAX_LOGIT_BIAS = 1024
"""Token ids one request's logit_bias may name (the frontend's `validation.MAX_LOGIT_BIAS`)."""


def failed_output(request_id: str, error: str, code: str = ErrorCode.UNAVAILABLE) -> TokenOut:
    """The final output of a request that fails before it produced anything."""
    return TokenOut(request_id=request_id, token_ids=[], finish_reason=FinishReason.ERROR, error=error,
                    error_code=code)


def check_params(p: SamplingParams, vocab_size: int) -> str:
    """The first bad field of `p` as ``"params.<field>: <problem>"``; "" when all are good."""
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        return f"params.temperature: must be a finite number >= 0, got {p.temperature}"
    if not 0 < p.top_p <= 1:
        return f"params.top_p: must be in (0, 1], got {p.top_p}"
    if p.top_k < 0:
        return f"params.top_k: must be >= 0 (0 = off), got {p.top_k}"
    if not 0 <= p.min_p <= 1:
        return f"params.min_p: must be in [0, 1], got {p.min_p}"
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        return f"params.repetition_penalty: must be a finite number > 0, got {p.repetition_penalty}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(p, name)):
            return f"params.{name}: must be a finite number, got {getattr(p, name)}"
    if p.seed is not None and not SEED_RANGE[0] <= p.seed < SEED_RANGE[1]:
        return f"params.seed: must be in [-2**63, 2**64), got {p.seed}"
    if not 1 <= p.max_new_tokens <= MAX_NEW_TOKENS:
        return f"params.max_new_tokens: must be in 1..2**63-1, got {p.max_new_tokens}"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}"
    for i, tid in enumerate(p.stop_token_ids):
        if not 0 <= tid < vocab_size:
            return f"params.stop_token_ids[{i}]: id {tid} is not in [0, {vocab_size})"
    if not 0 <= p.logprobs <= MAX_LOGPROBS:
        return f"params.logprobs: must be in 0..{MAX_LOGPROBS}, got {p.logprobs}"
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        return f"params.logit_bias: at most {MAX_LOGIT_BIAS} ids, got {len(p.logit_bias)}"
    for tid, bias in p.logit_bias.items():
        if not 0 <= tid < vocab_size:
            return f"params.logit_bias[{tid}]: id {tid} is not in [0, {vocab_size})"
        if not (math.isfinite(bias) and abs(bias) <= 100):
            return f"params.logit_bias[{tid}]: must be in [-100, 100], got {bias}"
    return ""
