"""Structured outputs in the runner: a constrained request's grammar matcher, and each step's
token masks.

A request whose `SamplingParams.grammar` is set (llguidance grammar text, compiled and checked
by the frontend: `kvserve.model.grammars`) gets a `llguidance.LLMatcher` at `Constrainer.matcher`.
Each step, `Constrainer.fill` computes the allowed-token bitmask of every constrained row that
samples, row after row on one thread of its own, started before the forward and read after it
(`Fill.result`): the masks are computed while the model runs. (llguidance's parallel executor
and a fill inline before the forward were measured slower here: on 2 cores they fight the
forward's OpenMP threads; bench/structured_cost.py.) The sampler applies a mask to
its row only (`Sampler.sample(..., masks=)`), so unconstrained rows in the same step pay
nothing and keep their numbers. After sampling, `accept` feeds the token to the matcher: the
request ends ("stop") when the grammar is complete, and fails when the matcher refuses the token
(which a mask makes impossible unless the grammar library errs).

A grammar is compiled once per runner for its text: the last `MATCHERS_KEPT` grammars are kept as
matchers at their start, and a request gets a copy (`deep_copy`: 10 µs where compiling a 17 kB
schema takes 6 ms, and n choices compile once). A matcher lives on the request, so a preempted
request resumes with it where it was. Knows
llguidance and torch; nothing about memsvc, sockets or the scheduler's tables.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.torch
import torch

from kvserve.model.grammars import LIMITS, llg_tokenizer

MATCHERS_KEPT = 64
"""Grammars a runner keeps compiled (a matcher at the start of each), least recently used out."""


class Fill:
    """The masks of one step's constrained rows, being computed."""

    def __init__(self, rows: list[int], future: Future, bitmask: torch.Tensor) -> None:
        self.rows = rows  # indices into the step's sampling rows
        self._future = future
        self._bitmask = bitmask
        self.seconds = 0.0  # how long the masks took on their thread (once `result` returned)
        self.empty: set[int] = set()  # rows whose grammar allows no token (once `result` returned)

    def result(self) -> tuple[list[int], torch.Tensor]:
        """(rows, int32 bitmask [len(rows), ceil(V / 32)]) once the masks are done. A row whose
        mask allows nothing is put in `empty` and left unmasked (its draw is thrown away: the
        scheduler fails the request by name)."""
        self.seconds = self._future.result()
        dead = (self._bitmask == 0).all(dim=1)
        if bool(dead.any()):
            self.empty = {self.rows[i] for i in dead.nonzero()[:, 0].tolist()}
            self._bitmask[dead] = -1
        return self.rows, self._bitmask


class Constrainer:
    """Matchers and masks for one runner's model: `tokenizer_json` gives the model tokenizer's
    to_str(), `n_vocab` is the width of its logits. Both that JSON and the llguidance tokenizer
    (about 0.2 s) are made at the first constrained request, not at start."""

    def __init__(self, tokenizer_json: Callable[[], str], n_vocab: int, eos_token_ids: list[int]) -> None:
        self._json = tokenizer_json
        self.n_vocab = n_vocab
        self.eos = list(eos_token_ids)
        self._tok: llguidance.LLTokenizer | None = None
        self._fresh = functools.lru_cache(maxsize=MATCHERS_KEPT)(self._compile)  # grammar text -> matcher
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="runner-grammar")  # started at its first fill

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tok is None:
            self._tok = llg_tokenizer(self._json(), self.n_vocab, self.eos)
        return self._tok

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher at the start of `grammar`; ValueError with llguidance's message when the
        grammar does not compile (the frontend checks it first: this is a hostile peer's)."""
        return self._fresh(grammar).deep_copy()

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if m.is_error():  # raised, so not kept
            raise ValueError(m.get_error())
        return m

    def fill(self, rows: list[int], matchers: list[Any]) -> Fill:
        """Start computing the masks of `matchers` (those of sampling rows `rows`, one or more)."""
        bitmask = llguidance.torch.allocate_token_bitmask(len(rows), self.n_vocab)
        pairs = [(m, i) for i, m in enumerate(matchers)]

        def masks() -> float:
            start = time.perf_counter()
            for m, i in pairs:
                llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
            return time.perf_counter() - start

        return Fill(rows, self._thread.submit(masks), bitmask)

    @staticmethod
    def accept(matcher: Any, token_id: int) -> tuple[bool, str]:
        """Feed the sampled `token_id`: (grammar complete, error: "" unless it was refused)."""
        if not matcher.consume_token(token_id):
            return False, matcher.get_error() or f"token {token_id} is not allowed by the grammar"
        return matcher.is_stopped(), ""
