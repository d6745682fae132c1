"""What the runner asks memsvc each step: the step's work, its grows, admissions and the reply.

`KVPlanner.plan` picks the step's work under the token budget (one token per decode, a
chunk per prefill, then the waiting requests that fit) and the `Grow`s the running rows
need. When anything needs memsvc (admissions, grows, commits of finished prompts,
releases), `KVPlanner.exchange` sends ONE step message and applies the reply: admitted
requests start running, refused grows preempt the latest-admitted requests (their
computed KV committed, requeued, recomputed later), and an admission refused because the
pool is exhausted waits `ADMIT_RETRY_S` before it is asked again.

This module knows the request table and the memsvc step items; it knows nothing about the
model, sampling or sockets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.messages.runner_memsvc import (
    REASON_EXHAUSTED,
    REASON_LOADING,
    Admit,
    Commit,
    Grow,
    Layout,
    Release,
)
from kvserve.runner.requests import Request, RequestTable, State

ADMIT_RETRY_S = 0.05
"""After memsvc refuses an admission as exhausted, wait this long before asking again
(unless this runner frees something first)."""
LOADING_RETRY_S = 0.005
"""After memsvc answers that a prompt's cached blocks are on their way from its disk tier,
ask again for that request after this long; the requests behind it are admitted meanwhile."""

Work = list[tuple[Request, int]]
"""The step's requests and how many tokens each computes in the forward."""


@dataclass(slots=True)
class StepPlan:
    """One step's work before memsvc has answered."""

    work: Work = field(default_factory=list)
    grows: list[Grow] = field(default_factory=list)
    admitting: Work = field(default_factory=list)


@dataclass(slots=True)
class Exchange:
    """memsvc's answer, applied: the work to run and the admissions that failed for good."""

    work: Work
    failed: list[tuple[Request, str]]


class KVPlanner:
    """The memsvc side of one runner's scheduling: pending commits and releases, memsvc
    request ids, admission order and the back-off after an exhausted pool."""

    def __init__(self, layout: Layout, *, max_running: int, max_batch_tokens: int,
                 chunk_size: int, metrics: Any = None) -> None:
        self.layout = layout
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.metrics = metrics
        self.commits: dict[int, Commit] = {}
        self.releases: list[Release] = []
        self.num_preemptions = 0
        self._next_mem_id = 1
        self._admit_seq = 0
        self._admit_retry_at = 0.0

    @property
    def pending(self) -> bool:
        """True when commits or releases wait for the next step message."""
        return bool(self.commits or self.releases)

    def forget(self) -> None:
        """Drop pending items: the lease they belonged to is gone."""
        self.commits, self.releases = {}, []

    # ---- planning ----------------------------------------------------------------------
    def plan(self, table: RequestTable, now: float) -> StepPlan:
        """The running requests' work and grows, then the admissions that fit the budget."""
        step = StepPlan()
        budget = self.max_batch_tokens
        for req in table.running:
            n = req.next_extend(self.chunk_size, budget)
            if n == 0:
                continue
            need = req.computed + n
            if need > req.capacity:
                step.grows.append(Grow(req.mem_id, self._grow_target(req, need)))
            step.work.append((req, n))
            budget -= n
        room = self.max_running - len(table.running)
        if now < self._admit_retry_at and not self.releases:
            room = 0  # the pool refused an admission just now and we freed nothing since
        loading: list[Request] = []  # their blocks are still on the way: passed over this time
        while table.waiting and budget > 0 and room > 0:
            req = table.waiting.popleft()
            if req.load_wait_until > now:
                loading.append(req)
                continue
            n = req.next_extend(self.chunk_size, budget)
            req.mem_id, self._next_mem_id = self._next_mem_id, self._next_mem_id + 1
            step.admitting.append((req, n))
            budget -= n
            room -= 1
        table.requeue_front(loading)
        return step

    def needs_memsvc(self, step: StepPlan) -> bool:
        return bool(step.admitting or step.grows or self.pending)

    def _grow_target(self, req: Request, need: int) -> int:
        target = max(need, req.capacity + self.layout.grow_chunk)
        return max(need, min(target, req.max_tokens))

    def _top_up(self, step: StepPlan) -> None:
        """A message goes to memsvc anyway: also grow the rows that would need it soon, so
        that the following decode steps need no message."""
        growing = {g.request_id for g in step.grows}
        soon = self.layout.grow_chunk // 2
        for req, n in step.work:
            need = req.computed + n
            if req.mem_id not in growing and req.capacity < req.max_tokens and req.capacity - need < soon:
                step.grows.append(Grow(req.mem_id, self._grow_target(req, need)))

    # ---- commits and releases ----------------------------------------------------------
    def commit(self, req: Request) -> None:
        """req's prompt KV is computed: insert it into the prefix cache with the next step."""
        self.commits[req.mem_id] = Commit(req.mem_id, req.tokens[: req.computed])

    def release(self, req: Request, *, keep_kv: bool) -> None:
        """Queue the release of req's row (committing its computed KV when `keep_kv`)."""
        self.commits.pop(req.mem_id, None)
        tokens = req.tokens[: req.computed] if keep_kv and req.computed > 0 else None
        self.releases.append(Release(req.mem_id, tokens))
        req.unbind()

    # ---- the round trip ----------------------------------------------------------------
    def exchange(self, step: StepPlan, mem: Any, table: RequestTable, now: float) -> Exchange:
        """Send the step message and apply the reply; on a memsvc error the admissions go
        back to the head of the queue and the error propagates."""
        self._top_up(step)
        admits = [Admit(r.mem_id, list(r.tokens), r.params.max_new_tokens - r.num_output)
                  for r, _ in step.admitting]
        t0 = time.perf_counter()
        try:
            reply = mem.step(admit=admits, grow=step.grows, commit=list(self.commits.values()),
                             release=self.releases)
        except BaseException:
            table.requeue_front([r for r, _ in step.admitting])
            for r, _ in step.admitting:
                r.mem_id = -1
            raise
        self.forget()
        if self.metrics is not None:
            self.metrics.memsvc_calls.inc()
            self.metrics.step_seconds.labels(phase="memsvc").observe(time.perf_counter() - t0)
        failed = self._admitted(step, reply, table, now)
        refused = {g.request_id for g in reply.grown if not g.ok}
        grown = {g.request_id: g.capacity for g in reply.grown if g.ok}
        for req, _ in step.work:
            if req.mem_id in grown:
                req.capacity = max(req.capacity, grown[req.mem_id])
        work = self._preempt(step.work, table, len(refused)) if refused else step.work
        return Exchange(work=work, failed=failed)

    def _admitted(self, step: StepPlan, reply: Any, table: RequestTable,
                  now: float) -> list[tuple[Request, str]]:
        """Start the admitted requests (appended to the step's work), requeue those the
        exhausted pool refused; return the ones refused for another reason."""
        results = {a.request_id: a for a in reply.admitted}
        blocked: list[Request] = []
        loading: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for req, n in step.admitting:
            res = results.get(req.mem_id)
            if res is not None and not res.ok and res.reason == REASON_EXHAUSTED:
                req.mem_id = -1
                blocked.append(req)
                continue
            if res is not None and not res.ok and res.reason == REASON_LOADING:
                req.mem_id = -1
                req.load_wait_until = now + LOADING_RETRY_S
                loading.append(req)
                continue
            if res is None or not res.ok:
                why = res.reason if res is not None else "; ".join(reply.errors) or "no admit result"
                failed.append((req, f"memsvc: {why}"))
                continue
            req.row, req.capacity, req.computed = res.row, res.capacity, res.cached_len
            req.commit_at, req.committed = len(req.tokens), False
            if req.cached_tokens < 0:
                req.cached_tokens = min(res.cached_len, req.prompt_len)
                req.queue_time = max(0.0, now - req.arrival)
            req.admitted_seq, self._admit_seq = self._admit_seq, self._admit_seq + 1
            table.start(req)
            step.work.append((req, min(n, len(req.tokens) - req.computed)))
        table.requeue_front(loading + blocked)
        self._admit_retry_at = now + ADMIT_RETRY_S if blocked else 0.0
        return failed

    def _preempt(self, work: Work, table: RequestTable, refusals: int) -> Work:
        """Grows were refused: preempt the latest-admitted requests, one per refusal, and
        drop from this step every request whose row is too short."""
        victims: list[Request] = []
        for _ in range(refusals):
            cands = [r for r in table.running if r not in victims]
            if not cands:
                break
            victims.append(max(cands, key=lambda r: r.admitted_seq))
        for req in victims:
            table.stop_running(req)
            self.release(req, keep_kv=True)
            self.num_preemptions += 1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
        table.requeue_front(sorted(victims, key=lambda r: r.admitted_seq))
        return [(r, n) for r, n in work if r.state is State.RUNNING and r.computed + n <= r.capacity]
