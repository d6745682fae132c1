"""Continuous batching over memsvc slots: the runner's scheduling step, without sockets.

`Scheduler.step()` does, in order: apply aborts; let the `KVPlanner` (kvplan.py) plan the
step and, when anything needs memsvc, make its ONE step message; run one forward over the
flat batch; sample; and return the new tokens of the whole batch as `TokenOut`s (one list
per step, for one `TokenBatch`).

The scheduler is built from a model, a memclient-like object (``step(admit=, grow=,
commit=, release=)``, ``req_to_token``, ``k_buffer``, ``v_buffer``, ``kv_usage()``), the
pool layout and a clock, so tests drive it directly. It knows nothing about ZMQ, the
frontend or how memsvc is reached; memsvc errors propagate to the caller, which calls
`fail_running` and `rebind` after re-attaching.

The frontend link is a socket: `add` checks every field of a `GenerateReq` (a buggy or
hostile peer can send anything that decodes) and fails a bad one with an error naming
the field. A request whose logits come out NaN or inf fails with error_code INTERNAL,
its KV released uncommitted (it may hold the NaNs).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.kernels import native
from kvserve.messages.frontend_runner import (
    ErrorCode,
    FinishReason,
    GenerateReq,
    TokenOut,
)
from kvserve.messages.runner_memsvc import Layout
from kvserve.runner.batching import ForwardBatch
from kvserve.runner.checks import MAX_WAITING, check_params, failed_output
from kvserve.runner.grammar import Constrainer
from kvserve.runner.kvplan import KVPlanner, Work
from kvserve.runner.requests import Request, RequestTable, State
from kvserve.runner.sampling import PenaltyState, Sampler, SampleRow, is_greedy, needs_penalties

log = logging.getLogger("kvserve.runner")

@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching limits of one runner, and the seed of the generator its unseeded sampled
    requests share: 0 (the default) = fresh entropy at start, so that no two runners (or
    restarts) draw the same tokens; another value repeats them run after run (tests,
    debugging). A request's own seed is reproducible whatever this is."""

    max_running: int = 256
    max_batch_tokens: int = 2048
    chunk_size: int = 512
    seed: int = 0
    batch_invariant: bool = True  # `LlamaForCausalLM.use_row_ops`'s


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
        fault_layer_delay_s: float = 0.0,
        constrainer: Constrainer | None = None,
    ) -> None:
        """`constrainer` masks the requests that carry a grammar; without one they are refused."""
        self.model = model
        self.constrainer = constrainer
        self.backend = backend
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.metrics = metrics
        self.workspace = workspace
        self.eos_ids = frozenset(eos_token_ids)
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.device = torch.device(model.device)
        if self.device.type == "cpu" and hasattr(model, "use_row_ops"):
            model.use_row_ops(native, batch_invariant=self.config.batch_invariant)  # the native row ops where they build
        self.sampler = Sampler(device=self.device, seed=self.config.seed or None,
                               argmax=native.row_argmax if self.device.type == "cpu" else None)
        self.table = RequestTable()
        self._outbox: list[TokenOut] = []
        self._aborts: list[str] = []
        self.ran_forward = False
        self.fault_layer_delay_s = fault_layer_delay_s  # test hook (runner main's): a sleep before each layer's fence
        self.kv = KVPlanner(layout, max_running=self.config.max_running,
                            max_batch_tokens=self.config.max_batch_tokens,
                            chunk_size=self.config.chunk_size, metrics=metrics)
        self.rebind(mem, layout)

    def _layer_fence(self) -> Callable[[int], None]:
        """The lease check before each layer's KV write; with the fault hook's delay set, the
        forward sleeps that long before each check (a stop then lands mid-step nearly always)."""
        check, delay = self.mem.fence, self.fault_layer_delay_s
        if delay <= 0:
            return check

        def slow_fence(layer: int) -> None:
            time.sleep(delay)
            check(layer)

        return slow_fence

    # ---- requests in -------------------------------------------------------------------
    def rebind(self, mem: Any, layout: Layout) -> None:
        """Use a (re-)attached memclient; call after `fail_running` on a memsvc failure."""
        self.mem, self.layout = mem, layout
        self.kv.layout = layout
        self.max_context_len = layout.max_context_len

    def add(self, msg: GenerateReq) -> None:
        """Queue a request; invalid ones produce an error output at the next step."""
        p = msg.params
        refused = self._validate(msg)
        if refused is not None:
            self._outbox.append(refused)
            return
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        row = SampleRow(p, seed=p.seed if not is_greedy(p) else None)
        if needs_penalties(p):
            row.penalties = PenaltyState.create(msg.token_ids, self.vocab_size, self.device)
        if p.logit_bias:
            row.bias = (torch.tensor(list(p.logit_bias), dtype=torch.long, device=self.device),
                        torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=self.device))
        if p.grammar:
            if self.constrainer is None:
                self._outbox.append(failed_output(msg.request_id, "params.grammar: this runner has no tokenizer "
                                                  "to constrain with", ErrorCode.INVALID_ARGUMENT))
                return
            try:
                row.matcher = self.constrainer.matcher(p.grammar)
            except ValueError as exc:
                self._outbox.append(failed_output(msg.request_id, f"params.grammar: {exc}",
                                                  ErrorCode.INVALID_ARGUMENT))
                return
        n = len(msg.token_ids)
        req = Request(
            request_id=msg.request_id, prompt_len=n, tokens=list(msg.token_ids), params=p,
            arrival=msg.arrival_time if msg.arrival_time > 0 else self.clock(),
            stop_ids=frozenset(stop), max_tokens=min(n + p.max_new_tokens, self.max_context_len),
            sample_row=row,
        )
        self.table.add(req)

    def _validate(self, msg: GenerateReq) -> TokenOut | None:
        """The error output refusing `msg`, or None when every field is good."""
        n = len(msg.token_ids)
        rid = msg.request_id
        if rid in self.table:
            return failed_output(rid, f"request_id {rid!r} is already in use on this runner", ErrorCode.INTERNAL)
        if len(self.table.waiting) >= MAX_WAITING:
            return failed_output(rid, f"the runner's queue is full ({MAX_WAITING} requests waiting)")
        error = ""
        if n == 0:
            error = "token_ids: the prompt is empty"
        elif n >= self.max_context_len:
            error = f"token_ids: prompt of {n} tokens does not fit the context length {self.max_context_len}"
        elif min(msg.token_ids) < 0 or max(msg.token_ids) >= self.vocab_size:
            error = f"token_ids: ids must be in [0, {self.vocab_size})"
        elif not math.isfinite(msg.arrival_time):
            error = f"arrival_time: must be a finite number, got {msg.arrival_time}"
        else:
            error = check_params(msg.params, self.vocab_size)
        return failed_output(rid, error, ErrorCode.INVALID_ARGUMENT) if error else None

    def abort(self, request_id: str) -> None:
        """Abort `request_id` at the start of the next step (unknown request_ids are ignored)."""
        self._aborts.append(request_id)

    def fail_unqueued(self, request_id: str, error: str) -> None:
        """`add` raised for `request_id`: fail it with `error` at the next step, unless it
        was queued after all (then it runs)."""
        if request_id not in self.table:
            self._outbox.append(failed_output(request_id, error, ErrorCode.INTERNAL))

    # ---- state -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.table.running)

    @property
    def num_waiting(self) -> int:
        return len(self.table.waiting)

    def retry_in(self, now: float) -> float | None:
        """Seconds until a waiting request whose cached blocks memsvc is loading is asked for
        again (None: no such request): the loop must not sleep past it."""
        due = [r.load_wait_until for r in self.table.waiting if r.load_wait_until > now]
        return min(due) - now if due else None

    def has_work(self) -> bool:
        """True when `step()` has something to do."""
        return bool(self.table.by_rid or self._outbox or self._aborts or self.kv.pending)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[TokenOut]:
        """Run one scheduling step; return the new outputs of every request it touched."""
        out, self._outbox = self._outbox, []
        self.ran_forward = False
        self._apply_aborts(out)
        now = self.clock()
        plan = self.kv.plan(self.table, now)
        work = plan.work
        if self.kv.needs_memsvc(plan):
            done = self.kv.exchange(plan, self.mem, self.table, now)
            work = done.work
            for req, error in done.failed:
                self.table.by_rid.pop(req.request_id, None)  # already off the waiting queue
                req.state = State.FINISHED
                out.append(self._final(req, FinishReason.ERROR, error=error))
        if work:
            out.extend(self._forward(work))
        return out

    @property
    def num_preemptions(self) -> int:
        return self.kv.num_preemptions

    def _apply_aborts(self, out: list[TokenOut]) -> None:
        for request_id in self._aborts:
            req = self.table.by_rid.get(request_id)
            if req is None:
                continue
            if req.state is State.RUNNING:
                self.kv.release(req, keep_kv=True)
            out.append(self._final(req, FinishReason.ABORT))
            self.table.finish(req)
        self._aborts.clear()

    def _forward(self, plan: Work) -> list[TokenOut]:
        t0 = time.perf_counter()
        model = self.model
        cfg = model.config
        batch = ForwardBatch.build(
            plan, req_to_token=self.mem.req_to_token, num_q_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, device=self.device,
            workspace=self.workspace, invariant=self.config.batch_invariant,
        )
        constrained = [i for i, r in enumerate(batch.sampling) if r.sample_row.matcher is not None]
        fill = None
        if constrained and self.constrainer is not None:  # the masks are computed while the model runs
            fill = self.constrainer.fill(constrained, [batch.sampling[i].sample_row.matcher for i in constrained])
        logits = model.forward(
            batch.input_ids, batch.meta, k_buffer=self.mem.k_buffer, v_buffer=self.mem.v_buffer,
            backend=self.backend, logits_indices=batch.logits_indices, fence=self._layer_fence(),
            float_logits=False,  # the sampler widens them where a row needs more than its greedy token
        )
        # The read side: a lease that ran out during the step (the process was stopped after
        # the last layer's write) may have let the row's slots be reused while attention read
        # them, so nothing this step computed may be emitted or committed.
        self.mem.fence()
        self.ran_forward = True
        t1 = time.perf_counter()
        for req, n in plan:
            req.computed += n
            if not req.committed and req.computed >= req.commit_at:
                req.committed = True
                self.kv.commit(req)
        out: list[TokenOut] = []
        if batch.sampling:
            for r in batch.sampling:
                r.sample_row.index = len(r.tokens) - r.prompt_len  # the output token it draws
            masks = fill.result() if fill is not None else None
            if fill is not None and self.metrics is not None:
                self.metrics.step_seconds.labels(phase="mask").observe(fill.seconds)
                self.metrics.masked_rows.inc(len(fill.rows))
            sampled = self.sampler.sample(logits, [r.sample_row for r in batch.sampling], masks=masks)
            dead = fill.empty if fill is not None else set()
            for i, (req, tok, lp, bad) in enumerate(zip(batch.sampling, sampled.token_ids, sampled.logprobs,
                                                        sampled.nonfinite, strict=True)):
                if i in dead:
                    out.append(self._fail_grammar(req, "the grammar allows no token here"))
                else:
                    out.append(self._fail_nonfinite(req) if bad else self._emit(req, tok, lp))
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
        matcher = req.sample_row.matcher
        if matcher is not None:
            done, error = Constrainer.accept(matcher, tok)
            if error:
                return self._fail_grammar(req, error)
            if done:
                reason = FinishReason.STOP
        if reason or tok in req.stop_ids:
            reason = FinishReason.STOP
        elif len(req.tokens) >= req.max_tokens:
            reason = FinishReason.LENGTH
        out = TokenOut(
            request_id=req.request_id, token_ids=[tok], logprobs=[lp] if lp is not None else [],
            finish_reason=reason, cached_tokens=max(req.cached_tokens, 0),
            queue_time=0.0 if req.first_sent else req.queue_time,
        )
        req.first_sent = True
        if reason:
            self.kv.release(req, keep_kv=True)
            self.table.finish(req)
        return out

    def _fail_nonfinite(self, req: Request) -> TokenOut:
        """The model gave `req` NaN or inf logits: fail it (INTERNAL), its KV released
        without a commit, so that nothing it computed enters the prefix cache."""
        log.error("request %s: non-finite logits at position %d; failing it", req.request_id, len(req.tokens))
        if self.metrics is not None:
            self.metrics.nonfinite_logits.inc()
        self.kv.release(req, keep_kv=False)
        out = self._final(req, FinishReason.ERROR, error="the model produced non-finite logits (NaN or inf)",
                          code=ErrorCode.INTERNAL)
        self.table.finish(req)
        return out

    def _fail_grammar(self, req: Request, error: str) -> TokenOut:
        """The grammar refused the token its own mask allowed, or allows none: fail `req` (INTERNAL)."""
        log.error("request %s: the grammar refused its sampled token: %s", req.request_id, error)
        self.kv.release(req, keep_kv=True)
        out = self._final(req, FinishReason.ERROR, error=f"structured output: {error}", code=ErrorCode.INTERNAL)
        self.table.finish(req)
        return out

    def _final(self, req: Request, reason: str, error: str = "", code: str = ErrorCode.UNAVAILABLE) -> TokenOut:
        return TokenOut(
            request_id=req.request_id, token_ids=[], finish_reason=reason,
            cached_tokens=max(req.cached_tokens, 0),
            queue_time=0.0 if req.first_sent or req.queue_time < 0 else req.queue_time, error=error,
            error_code=code,
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
        self.kv.forget()
        return out

    def drain_offline(self) -> list[TokenOut]:
        """Outputs that need no memsvc (errors, aborts of waiting requests), while detached."""
        out, self._outbox = self._outbox, []
        keep = []
        for request_id in self._aborts:
            req = self.table.by_rid.get(request_id)
            if req is not None and req.state is State.RUNNING:
                keep.append(request_id)
        self._aborts = [r for r in self._aborts if r not in keep]
        self._apply_aborts(out)
        self._aborts = keep
        return out
