"""Token sampling for one scheduler step, vectorized over the batch.

Order of operations per row (the order vLLM and transformers use): repetition /
presence / frequency penalties on the logits; greedy rows (temperature 0) take the
argmax; the others are divided by their temperature, filtered by top-k, then top-p,
then min-p, and sampled by an exponential race (``argmax(p / E)``, ``E ~ Exp(1)``),
which picks token i with probability p_i. A seeded request draws its noise from its own
`torch.Generator`, one full-vocabulary draw per sampled token, so its output does not
depend on what else is in the batch. Logprobs are those of the model's raw distribution
(log-softmax of the unprocessed logits), the sampled token's and the top-n.

When the whole batch is greedy, unpenalized and wants no logprobs, sampling is one
argmax. This module knows nothing about requests' lifecycles, memsvc or sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.messages.frontend_runner import SamplingParams, TokenLogprob


def needs_penalties(params: SamplingParams) -> bool:
    """True when `params` asks for any repetition, presence or frequency penalty."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass(slots=True)
class PenaltyState:
    """Per-request token statistics the penalties read: which tokens the prompt holds and
    how often each token has been generated."""

    prompt_mask: torch.Tensor  # [V] bool
    counts: torch.Tensor  # [V] float32, generated tokens only

    @classmethod
    def create(
        cls, prompt_ids: Sequence[int], vocab_size: int, device: torch.device | str,
        output_ids: Sequence[int] = (),
    ) -> PenaltyState:
        """State for a request whose prompt is `prompt_ids` and output so far `output_ids`."""
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if len(prompt_ids):
            mask[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if len(output_ids):
            ids = torch.tensor(list(output_ids), dtype=torch.long, device=device)
            counts.index_add_(0, ids, torch.ones(ids.numel(), device=device))
        return cls(prompt_mask=mask, counts=counts)

    def add(self, token_id: int) -> None:
        """Count one more generated `token_id`."""
        self.counts[token_id] += 1.0


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    generator: torch.Generator | None = None  # set for seeded requests
    penalties: PenaltyState | None = None  # set when needs_penalties(params)


@dataclass(slots=True)
class SampleOutput:
    """Sampled token per row; logprobs per row (None where the request wants none)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request (its whole sampling stream)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[int], states: Sequence[PenaltyState],
    params: Sequence[SamplingParams],
) -> None:
    """Apply penalties in place to `logits[rows]` ([B, V] float32).

    repetition (transformers semantics, tokens of prompt or output): positive logits are
    divided by the penalty, negative ones multiplied; presence: minus `presence` for each
    token generated at least once; frequency: minus `frequency` times its count.
    """
    dev = logits.device
    idx = torch.tensor(list(rows), dtype=torch.long, device=dev)
    sub = logits.index_select(0, idx)
    counts = torch.stack([s.counts for s in states])
    seen_out = counts > 0
    seen = seen_out | torch.stack([s.prompt_mask for s in states])
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    factor = torch.where(seen, rep, torch.ones_like(rep))
    sub = torch.where(sub > 0, sub / factor, sub * factor)
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    sub = sub - freq * counts - pres * seen_out.float()
    logits.index_copy_(0, idx, sub)


def filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) all but each row's `top_k` largest logits (0 = no limit), then all but
    the smallest set whose probability reaches `top_p`; the top token always stays."""
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    pos = torch.arange(vocab, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = pos >= k[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before > top_p[:, None])
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def filter_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below `min_p` times each row's largest probability."""
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < floor, 0.0)


class Sampler:
    """Samples one token per row of a step's logits. Holds the generator that unseeded
    sampled requests share; seeded requests bring their own (`SampleRow.generator`)."""

    def __init__(self, *, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        """Pick the next token of each row of `logits` ([B, V] float32, one row per entry
        of `rows`). Does not mutate the penalty states: the caller counts the new tokens."""
        n = len(rows)
        if logits.shape[0] != n:
            raise ValueError(f"logits has {logits.shape[0]} rows, {n} sample rows given")
        params = [r.params for r in rows]
        top_n = max((p.logprobs for p in params), default=0)
        raw_logprobs = logits.log_softmax(dim=-1) if top_n > 0 else None
        penal = [i for i, r in enumerate(rows) if r.penalties is not None]
        if penal:
            logits = logits.clone()
            apply_penalties(
                logits, penal, [rows[i].penalties for i in penal], [params[i] for i in penal]  # type: ignore[misc]
            )
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        tokens = logits.argmax(dim=-1)
        if sampled:
            chosen = self._sample_rows(logits, sampled, rows)
            if len(sampled) == n:
                tokens = chosen
            else:
                idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
                tokens = tokens.index_copy(0, idx, chosen)
        token_ids = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * n
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, tokens, params, top_n)
        return SampleOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample_rows(
        self, logits: torch.Tensor, idx_list: list[int], rows: Sequence[SampleRow]
    ) -> torch.Tensor:
        dev = logits.device
        params = [rows[i].params for i in idx_list]
        idx = torch.tensor(idx_list, dtype=torch.long, device=dev)
        x = logits.index_select(0, idx) if len(idx_list) != logits.shape[0] else logits
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        x = x / temp[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            x = filter_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            probs = filter_min_p(probs, min_p)
        noise = torch.empty_like(probs)
        shared = [j for j, i in enumerate(idx_list) if rows[i].generator is None]
        if shared:
            draw = torch.empty(len(shared), probs.shape[1], device=dev)
            draw.exponential_(generator=self.generator)
            if len(shared) == len(idx_list):
                noise = draw
            else:
                noise[shared] = draw
        for j, i in enumerate(idx_list):
            gen = rows[i].generator
            if gen is not None:
                noise[j].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def _gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams], top_n: int
) -> list[TokenLogprob | None]:
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    top_vals, top_ids = logprobs.topk(top_n, dim=-1)
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        if p.logprobs <= 0:
            out.append(None)
            continue
        k = p.logprobs
        out.append(TokenLogprob(logprob=chosen[i], top_ids=top_ids_l[i][:k], top_logprobs=top_vals_l[i][:k]))
    return out
