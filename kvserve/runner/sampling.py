"""Token sampling for one scheduler step, vectorized over the batch.

Order of operations per row (the order vLLM and transformers use): a row whose logits
hold NaN or inf is not sampled (it is reported in `SampleOutput.nonfinite`, its
request fails); repetition / presence / frequency penalties on the logits; greedy rows
(temperature below `GREEDY_TEMPERATURE`) take the argmax; the others are divided by
their temperature, filtered by top-k, then top-p, then min-p, and sampled by an
exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which picks token i with
probability p_i. A seeded request's noise for its n-th output token is one
full-vocabulary draw from a generator seeded with a hash of (seed, n) (`draw_seed`): a
function of the seed and the position alone, so its output depends neither on what else
is in the batch, nor on the runner, nor on how many draws came before (a preempted and
recomputed request, or one resumed elsewhere, draws again what it drew). Unseeded
requests share the sampler's generator, seeded from fresh entropy unless a seed is given. Logprobs are those of the model's raw
distribution (log-softmax of the unprocessed logits), the sampled token's and the top-n.

Every step is kept finite whatever the (validated) parameters: penalized logits are
clamped to the float32 range and the temperature divides logits shifted so their
maximum is 0, so no row can overflow to inf and NaN. This module knows nothing about
requests' lifecycles, memsvc or sockets.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.messages.frontend_runner import GREEDY_TEMPERATURE, SamplingParams, TokenLogprob

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny
SEED_RANGE = (-(1 << 63), 1 << 64)
"""Seeds a request may carry: what `torch.Generator.manual_seed` takes (and msgpack can carry)."""


def is_greedy(params: SamplingParams) -> bool:
    """True when `params` samples greedily: temperature below `GREEDY_TEMPERATURE` (dividing
    logits by such a temperature overflows float32)."""
    return params.temperature < GREEDY_TEMPERATURE


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
    seed: int | None = None  # set for seeded sampled requests
    index: int = 0  # which output token of the request this row draws (the scheduler sets it)
    penalties: PenaltyState | None = None  # set when needs_penalties(params)
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: (token ids, biases)
    matcher: Any = None  # the grammar matcher of a constrained request (kvserve.runner.grammar)

    @property
    def plain(self) -> bool:
        """Its token is the argmax of the raw logits (greedy, nothing added or masked)."""
        return (is_greedy(self.params) and self.params.logprobs <= 0 and self.penalties is None
                and self.bias is None and self.matcher is None)


@dataclass(slots=True)
class SampleOutput:
    """Sampled token per row; logprobs per row (None where the request wants none)."""

    token_ids: list[int]  # -1 where nonfinite
    logprobs: list[TokenLogprob | None]
    nonfinite: list[bool]  # the row's logits held NaN or inf: not sampled


def _check_seed(seed: int) -> None:
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed {seed} is outside [-2**63, 2**64)")


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's draw for its `index`-th output token (from
    0): 64 bits of BLAKE2b over the seed and the index, so neighbouring seeds and indices
    give unrelated streams."""
    _check_seed(seed)
    data = (seed & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little") + index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """The generator unseeded sampled requests share: seeded with `seed`, or with `seed`
    None from fresh entropy (`secrets`), different in every process."""
    if seed is None:
        seed = secrets.randbits(64)
    else:
        _check_seed(seed)
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
    token generated at least once; frequency: minus `frequency` times its count. Each
    result is clamped to the float32 range, so huge penalties give huge logits, never
    inf or NaN (finite logits and finite penalties in, finite logits out).
    """
    dev = logits.device
    idx = torch.tensor(list(rows), dtype=torch.long, device=dev)
    sub = logits.index_select(0, idx)
    counts = torch.stack([s.counts for s in states])
    seen_out = counts > 0
    seen = seen_out | torch.stack([s.prompt_mask for s in states])
    rep = _f32([p.repetition_penalty for p in params], dev).clamp(min=FLOAT32_TINY)
    factor = torch.where(seen, rep, torch.ones_like(rep))
    sub = torch.where(sub > 0, sub / factor, sub * factor).clamp(-FLOAT32_MAX, FLOAT32_MAX)
    pres = _f32([p.presence_penalty for p in params], dev)
    freq = _f32([p.frequency_penalty for p in params], dev)
    sub = (sub - (freq * counts).clamp(-FLOAT32_MAX, FLOAT32_MAX)).clamp(-FLOAT32_MAX, FLOAT32_MAX)
    sub = (sub - pres * seen_out.float()).clamp(-FLOAT32_MAX, FLOAT32_MAX)
    logits.index_copy_(0, idx, sub)


def _f32(values: list[float], device: torch.device) -> torch.Tensor:
    """[B, 1] float32 column of `values`, each clamped to the finite float32 range."""
    return torch.tensor(values, dtype=torch.float32, device=device).clamp(-FLOAT32_MAX, FLOAT32_MAX)[:, None]


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
    sampled requests share (seeded with `seed`, or from fresh entropy when it is None, so
    that two runners never draw the same "random" tokens); a seeded request's draws come
    from a generator seeded anew for each of them (`draw_seed`)."""

    def __init__(self, *, device: torch.device | str = "cpu", seed: int | None = None,
                 argmax: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> None:
        """`argmax`, where given (the native kernels' `row_argmax`), reads a step whose every
        row is plainly greedy in one pass: logits -> (first index of each row's largest
        value, whether the row is all finite), or None where it does not take them."""
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)
        self._keyed = torch.Generator(device=self.device)  # reseeded for each seeded draw
        self.argmax = argmax

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow],
               masks: tuple[list[int], torch.Tensor] | None = None) -> SampleOutput:
        """Pick the next token of each row of `logits` ([B, V] float32 or the model's dtype,
        one row per entry of `rows`). A row holding NaN or inf is not sampled: its
        `nonfinite` entry is True and its token -1. `masks`: (rows, int32 bitmask, a row of
        words per row: bit t of a row allows token t), the allowed tokens of the constrained
        rows (`kvserve.runner.grammar`). Does not mutate `logits` or the penalty states: the
        caller counts the new tokens."""
        n = len(rows)
        if logits.shape[0] != n:
            raise ValueError(f"logits has {logits.shape[0]} rows, {n} sample rows given")
        params = [r.params for r in rows]
        if self.argmax is not None and all(r.plain for r in rows):
            read = self.argmax(logits)
            if read is not None:
                top, finite = read
                token_ids = torch.where(finite, top, -1).tolist()
                return SampleOutput(token_ids=token_ids, logprobs=[None] * n, nonfinite=[t < 0 for t in token_ids])
        logits = logits.float()  # a no-op on float32
        # A row's maximum is NaN or +inf when it holds either, its minimum -inf when it holds
        # that: two reductions find the bad rows, and the maximum's index is the greedy token.
        # Bad rows become zeros (a copy of `logits`; on CPU only when there are any, on a GPU
        # always: no device sync) and -1 in the one .tolist().
        hi, top = logits.max(dim=-1)
        finite = torch.isfinite(hi) & torch.isfinite(logits.amin(dim=-1))
        copied = logits.device.type != "cpu" or not bool(finite.all())
        if copied:
            logits = torch.where(finite[:, None], logits, 0.0)
        top_n = min(max((p.logprobs for p in params), default=0), logits.shape[-1])
        raw_logprobs = logits.log_softmax(dim=-1) if top_n > 0 else None
        penal = [i for i, r in enumerate(rows) if r.penalties is not None]
        biased = [i for i, r in enumerate(rows) if r.bias is not None]
        changed = bool(penal or biased or masks)
        if changed and not copied:
            logits = logits.clone()  # penalties, biases and masks apply in place
        if penal:
            apply_penalties(
                logits, penal, [rows[i].penalties for i in penal], [params[i] for i in penal]  # type: ignore[misc]
            )
        for i in biased:
            ids, bias = rows[i].bias  # type: ignore[misc]
            logits[i].index_add_(0, ids, bias).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
        if masks:
            apply_masks(logits, *masks)
        sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
        tokens = logits.argmax(dim=-1) if changed else top
        if sampled:
            chosen = self._sample_rows(logits, sampled, rows)
            if len(sampled) == n:
                tokens = chosen
            else:
                idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
                tokens = tokens.index_copy(0, idx, chosen)
        token_ids = torch.where(finite, tokens, -1).tolist()
        nonfinite = [t < 0 for t in token_ids]
        logprobs: list[TokenLogprob | None] = [None] * n
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, tokens, params, top_n)
            logprobs = [None if bad else lp for lp, bad in zip(logprobs, nonfinite, strict=True)]
        return SampleOutput(token_ids=token_ids, logprobs=logprobs, nonfinite=nonfinite)

    def _sample_rows(
        self, logits: torch.Tensor, idx_list: list[int], rows: Sequence[SampleRow]
    ) -> torch.Tensor:
        dev = logits.device
        params = [rows[i].params for i in idx_list]
        idx = torch.tensor(idx_list, dtype=torch.long, device=dev)
        x = logits.index_select(0, idx) if len(idx_list) != logits.shape[0] else logits
        temp = _f32([p.temperature for p in params], dev)
        # Shifted so each row's maximum is 0: dividing by a small temperature then sends the
        # others towards -inf, never the maximum to +inf (whose softmax would be NaN).
        x = (x - x.amax(dim=-1, keepdim=True)) / temp
        vocab = x.shape[-1]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.long, device=dev)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            x = filter_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            probs = filter_min_p(probs, min_p)
        noise = torch.empty_like(probs)
        shared = [j for j, i in enumerate(idx_list) if rows[i].seed is None]
        if shared:
            draw = torch.empty(len(shared), probs.shape[1], device=dev)
            draw.exponential_(generator=self.generator)
            if len(shared) == len(idx_list):
                noise = draw
            else:
                noise[shared] = draw
        for j, i in enumerate(idx_list):
            row = rows[i]
            if row.seed is not None:
                self._keyed.manual_seed(draw_seed(row.seed, row.index))
                noise[j].exponential_(generator=self._keyed)
        # A draw of exactly 0 would make p / E inf, or NaN (the maximum) for a filtered token.
        return (probs / noise.clamp_(min=FLOAT32_TINY)).argmax(dim=-1)


_BAN = torch.tensor([[0.0 if (byte >> k) & 1 else float("-inf") for k in range(8)] for byte in range(256)])
"""Row b: what a mask byte b adds to its 8 tokens' logits (lowest bit first): 0 where allowed."""


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the float32 logits of `rows` whose bit in `bitmask` is 0 (a row of
    int32 words per row, bit t of word t // 32 for token t); the other rows are not touched.
    The words are read as little-endian bytes and each adds its row of `_BAN` (at 32 rows of
    49,152 tokens, 2 cores: 0.5 ms, against 10.6 ms shifting out every bit for a masked_fill)."""
    vocab = logits.shape[-1]
    ban = _BAN if logits.device.type == "cpu" else _BAN.to(logits.device)
    as_bytes = bitmask.to(logits.device).contiguous().view(torch.uint8).reshape(-1).long()
    add = ban.index_select(0, as_bytes).reshape(len(rows), -1)[:, :vocab]
    if rows == list(range(logits.shape[0])):
        logits.add_(add)
        return
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits.index_copy_(0, idx, logits.index_select(0, idx).add_(add))


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
