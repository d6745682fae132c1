"""Continuous batching over memsvc slots: the runner's scheduling step, without sockets.

`Scheduler.step()` does, in order: apply aborts; plan the running requests (one token per
decode, a chunk per prefill, under the step's token budget) and the admissions that fit;
send ONE memsvc step message if anything needs memsvc (admits, grows in `grow_chunk`
steps, commits of finished prompts, releases), handling exhaustion by preemption
(release with the computed KV committed, requeue, recompute later) or, for admissions, by
waiting; run one forward over the flat batch; sample; and return the new tokens of the
whole batch as `TokenOut`s (one list per step, for one `TokenBatch`).

The scheduler is built from a model, a memclient-like object (``step(admit=, grow=,
commit=, release=)``, ``req_to_token``, ``k_buffer``, ``v_buffer``, ``kv_usage()``), the
pool layout and a clock, so tests drive it directly. It knows nothing about ZMQ, the
frontend or how memsvc is reached; memsvc errors propagate to the caller, which calls
`fail_running` and `rebind` after re-attaching.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.messages.frontend_runner import FinishReason, GenerateReq, TokenOut
from kvserve.messages.runner_memsvc import REASON_EXHAUSTED, Admit, Commit, Grow, Layout, Release
from kvserve.runner.batching import ForwardBatch
from kvserve.runner.requests import Request, RequestTable, State
from kvserve.runner.sampling import (
    PenaltyState,
    Sampler,
    SampleRow,
    make_generator,
    needs_penalties,
)

ADMIT_RETRY_S = 0.05
"""After memsvc refuses an admission as exhausted, wait this long before asking again
(unless this runner frees something first)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching limits of one runner."""

    max_running: int = 256
    max_batch_tokens: int = 2048
    chunk_size: int = 512
    seed: int = 0


class Scheduler:
    """Continuous-batching scheduler of one runner (see the module docstring)."""

    def __init__(
        self,
        *,
        model: Any,
        mem: Any,
        layout: Layout,
        backend: Any,
        eos_token_ids: Sequence[int] = (),
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.time,
        metrics: Any = None,
        workspace: Any = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.metrics = metrics
        self.workspace = workspace
        self.eos_ids = frozenset(eos_token_ids)
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.device = torch.device(model.device)
        self.sampler = Sampler(device=self.device, seed=self.config.seed)
        self.table = RequestTable()
        self._outbox: list[TokenOut] = []
        self._aborts: list[str] = []
        self._commits: dict[int, Commit] = {}
        self._releases: list[Release] = []
        self._next_mem_rid = 1
        self._admit_seq = 0
        self.ran_forward = False
        self._admit_retry_at = 0.0
        self.num_preemptions = 0
        self.rebind(mem, layout)

    # ---- requests in -------------------------------------------------------------------
    def rebind(self, mem: Any, layout: Layout) -> None:
        """Use a (re-)attached memclient; call after `fail_running` on a memsvc failure."""
        self.mem, self.layout = mem, layout
        self.max_context_len = layout.max_context_len

    def add(self, msg: GenerateReq) -> None:
        """Queue a request; invalid ones produce an error output at the next step."""
        p = msg.params
        error = self._validate(msg)
        if error:
            self._outbox.append(TokenOut(rid=msg.rid, token_ids=[], finish_reason=FinishReason.ERROR,
                                         prompt_tokens=len(msg.token_ids), error=error))
            return
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        row = SampleRow(p)
        if p.seed is not None and p.temperature > 0:
            row.generator = make_generator(p.seed, self.device)
        if needs_penalties(p):
            row.penalties = PenaltyState.create(msg.token_ids, self.vocab_size, self.device)
        n = len(msg.token_ids)
        req = Request(
            rid=msg.rid, prompt_len=n, tokens=list(msg.token_ids), params=p,
            arrival=msg.arrival_time if msg.arrival_time > 0 else self.clock(),
            stop_ids=frozenset(stop), max_tokens=min(n + p.max_new_tokens, self.max_context_len),
            sample_row=row,
        )
        self.table.add(req)

    def _validate(self, msg: GenerateReq) -> str:
        n = len(msg.token_ids)
        if msg.rid in self.table:
            return f"rid {msg.rid!r} is already in use on this runner"
        if n == 0:
            return "token_ids: the prompt is empty"
        if n >= self.max_context_len:
            return f"token_ids: prompt of {n} tokens does not fit the context length {self.max_context_len}"
        if min(msg.token_ids) < 0 or max(msg.token_ids) >= self.vocab_size:
            return f"token_ids: ids must be in [0, {self.vocab_size})"
        if msg.params.max_new_tokens < 1:
            return "max_new_tokens: must be >= 1"
        return ""

    def abort(self, rid: str) -> None:
        """Abort `rid` at the start of the next step (unknown rids are ignored)."""
        self._aborts.append(rid)

    # ---- state -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.table.running)

    @property
    def num_waiting(self) -> int:
        return len(self.table.waiting)

    def has_work(self) -> bool:
        """True when `step()` has something to do."""
        return bool(self.table.by_rid or self._outbox or self._aborts or self._releases or self._commits)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[TokenOut]:
        """Run one scheduling step; return the new outputs of every request it touched."""
        out, self._outbox = self._outbox, []
        self.ran_forward = False
        self._apply_aborts(out)
        now = self.clock()
        budget = self.config.max_batch_tokens
        plan: list[tuple[Request, int]] = []
        grows: list[Grow] = []
        for req in self.table.running:
            n = req.next_extend(self.config.chunk_size, budget)
            if n == 0:
                continue
            need = req.computed + n
            if need > req.capacity:
                grows.append(Grow(req.mem_rid, self._grow_target(req, need)))
            plan.append((req, n))
            budget -= n
        admitting: list[tuple[Request, int]] = []
        room = self.config.max_running - self.num_running
        if now < self._admit_retry_at and not self._releases:
            room = 0  # the pool refused an admission just now and we freed nothing since
        while self.table.waiting and budget > 0 and room > 0:
            req = self.table.waiting.popleft()
            n = req.next_extend(self.config.chunk_size, budget)
            req.mem_rid, self._next_mem_rid = self._next_mem_rid, self._next_mem_rid + 1
            admitting.append((req, n))
            budget -= n
            room -= 1
        if admitting or grows or self._commits or self._releases:
            self._top_up(plan, grows)
            plan = self._memsvc_step(plan, grows, admitting, now)
        if plan:
            out.extend(self._forward(plan))
        return out

    def _grow_target(self, req: Request, need: int) -> int:
        target = max(need, req.capacity + self.layout.grow_chunk)
        return max(need, min(target, req.max_tokens))

    def _top_up(self, plan: list[tuple[Request, int]], grows: list[Grow]) -> None:
        """A message goes to memsvc anyway: also grow the rows that would need it soon, so
        that the following decode steps need no message."""
        growing = {g.rid for g in grows}
        soon = self.layout.grow_chunk // 2
        for req, n in plan:
            need = req.computed + n
            if req.mem_rid not in growing and req.capacity < req.max_tokens and req.capacity - need < soon:
                grows.append(Grow(req.mem_rid, self._grow_target(req, need)))

    def _apply_aborts(self, out: list[TokenOut]) -> None:
        for rid in self._aborts:
            req = self.table.by_rid.get(rid)
            if req is None:
                continue
            if req.state is State.RUNNING:
                self._release(req, keep_kv=True)
            out.append(self._final(req, FinishReason.ABORT))
            self.table.finish(req)
        self._aborts.clear()

    def _release(self, req: Request, *, keep_kv: bool) -> None:
        """Queue the release of req's row (committing its computed KV when `keep_kv`)."""
        self._commits.pop(req.mem_rid, None)
        tokens = req.tokens[: req.computed] if keep_kv and req.computed > 0 else None
        self._releases.append(Release(req.mem_rid, tokens))
        req.unbind()

    def _memsvc_step(
        self, plan: list[tuple[Request, int]], grows: list[Grow],
        admitting: list[tuple[Request, int]], now: float,
    ) -> list[tuple[Request, int]]:
        admits = [Admit(r.mem_rid, list(r.tokens), r.params.max_new_tokens - r.num_output)
                  for r, _ in admitting]
        commits, releases = list(self._commits.values()), self._releases
        t0 = time.perf_counter()
        try:
            reply = self.mem.step(admit=admits, grow=grows, commit=commits, release=releases)
        except BaseException:
            self.table.requeue_front([r for r, _ in admitting])
            for r, _ in admitting:
                r.mem_rid = -1
            raise
        self._commits, self._releases = {}, []
        if self.metrics is not None:
            self.metrics.memsvc_calls.inc()
            self.metrics.step_seconds.labels(phase="memsvc").observe(time.perf_counter() - t0)
        results = {a.rid: a for a in reply.admitted}
        blocked: list[Request] = []
        for req, n in admitting:
            res = results.get(req.mem_rid)
            if res is None or not res.ok:
                if res is None or res.reason != REASON_EXHAUSTED:
                    why = res.reason if res is not None else "; ".join(reply.errors) or "no admit result"
                    self._outbox.append(self._final(req, FinishReason.ERROR, error=f"memsvc: {why}"))
                    self.table.by_rid.pop(req.rid, None)
                    req.state = State.FINISHED
                    continue
                req.mem_rid = -1
                blocked.append(req)
                continue
            req.row, req.capacity, req.computed = res.row, res.capacity, res.cached_len
            req.commit_at, req.committed = len(req.tokens), False
            if req.cached_tokens < 0:
                req.cached_tokens = min(res.cached_len, req.prompt_len)
                req.queue_time = max(0.0, now - req.arrival)
            req.admitted_seq, self._admit_seq = self._admit_seq, self._admit_seq + 1
            self.table.start(req)
            plan.append((req, min(n, len(req.tokens) - req.computed)))
        self.table.requeue_front(blocked)
        self._admit_retry_at = now + ADMIT_RETRY_S if blocked else 0.0
        failed = [g.rid for g in reply.grown if not g.ok]
        grown = {g.rid: g.capacity for g in reply.grown if g.ok}
        for req, _ in plan:
            if req.mem_rid in grown:
                req.capacity = max(req.capacity, grown[req.mem_rid])
        if failed:
            plan = self._preempt(plan, set(failed))
        return plan

    def _preempt(self, plan: list[tuple[Request, int]], failed: set[int]) -> list[tuple[Request, int]]:
        """Grows in `failed` were refused: preempt the latest-admitted requests, one per
        refusal, and drop from this step every request whose row is too short."""
        victims: list[Request] = []
        for _ in failed:
            cands = [r for r in self.table.running if r not in victims]
            if not cands:
                break
            victims.append(max(cands, key=lambda r: r.admitted_seq))
        for req in victims:
            self.table.stop_running(req)
            self._release(req, keep_kv=True)
            self.num_preemptions += 1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
        self.table.requeue_front(sorted(victims, key=lambda r: r.admitted_seq))
        return [(r, n) for r, n in plan if r.state is State.RUNNING and r.computed + n <= r.capacity]

    def _forward(self, plan: list[tuple[Request, int]]) -> list[TokenOut]:
        t0 = time.perf_counter()
        model = self.model
        cfg = model.config
        batch = ForwardBatch.build(
            plan, req_to_token=self.mem.req_to_token, num_q_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, device=self.device,
            workspace=self.workspace,
        )
        logits = model.forward(
            batch.input_ids, batch.meta, k_buffer=self.mem.k_buffer, v_buffer=self.mem.v_buffer,
            backend=self.backend, logits_indices=batch.logits_indices,
        )
        self.ran_forward = True
        t1 = time.perf_counter()
        for req, n in plan:
            req.computed += n
            if not req.committed and req.computed >= req.commit_at:
                req.committed = True
                self._commits[req.mem_rid] = Commit(req.mem_rid, req.tokens[: req.computed])
        out: list[TokenOut] = []
        if batch.sampling:
            sampled = self.sampler.sample(logits, [r.sample_row for r in batch.sampling])
            for req, tok, lp in zip(batch.sampling, sampled.token_ids, sampled.logprobs, strict=True):
                out.append(self._emit(req, tok, lp))
        if self.metrics is not None:
            phase = "decode" if batch.is_decode else ("prefill" if not batch.sampling or len(plan) == 1 else "mixed")
            self.metrics.step_seconds.labels(phase=phase).observe(t1 - t0)
            self.metrics.step_seconds.labels(phase="sample").observe(time.perf_counter() - t1)
            self.metrics.batch_size.set(len(plan))
        return out

    def _emit(self, req: Request, tok: int, lp: Any) -> TokenOut:
        req.tokens.append(tok)
        if req.sample_row.penalties is not None:
            req.sample_row.penalties.add(tok)
        reason = ""
        if tok in req.stop_ids:
            reason = FinishReason.STOP
        elif len(req.tokens) >= req.max_tokens:
            reason = FinishReason.LENGTH
        out = TokenOut(
            rid=req.rid, token_ids=[tok], logprobs=[lp] if lp is not None else [],
            finish_reason=reason, prompt_tokens=req.prompt_len, cached_tokens=max(req.cached_tokens, 0),
            completion_tokens=req.num_output, queue_time=0.0 if req.first_sent else req.queue_time,
        )
        req.first_sent = True
        if reason:
            self._release(req, keep_kv=True)
            self.table.finish(req)
        return out

    def _final(self, req: Request, reason: str, error: str = "") -> TokenOut:
        return TokenOut(
            rid=req.rid, token_ids=[], finish_reason=reason, prompt_tokens=req.prompt_len,
            cached_tokens=max(req.cached_tokens, 0), completion_tokens=req.num_output,
            queue_time=0.0 if req.first_sent or req.queue_time < 0 else req.queue_time, error=error,
        )

    # ---- memsvc failure ----------------------------------------------------------------
    def fail_running(self, error: str) -> list[TokenOut]:
        """memsvc is gone: fail every request that holds KV or has streamed tokens (with
        finish_reason "error"); requests that streamed nothing stay queued. Forgets pending
        memsvc items (the lease is gone with the instance)."""
        out: list[TokenOut] = []
        for req in self.table:
            if req.state is State.RUNNING or req.num_output > 0:
                req.unbind()
                out.append(self._final(req, FinishReason.ERROR, error=error))
                self.table.finish(req)
        self._commits, self._releases = {}, []
        return out

    def drain_offline(self) -> list[TokenOut]:
        """Outputs that need no memsvc (errors, aborts of waiting requests), while detached."""
        out, self._outbox = self._outbox, []
        keep = []
        for rid in self._aborts:
            req = self.table.by_rid.get(rid)
            if req is not None and req.state is State.RUNNING:
                keep.append(rid)
        self._aborts = [r for r in self._aborts if r not in keep]
        self._apply_aborts(out)
        self._aborts = keep
        return out
