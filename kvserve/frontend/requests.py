"""The one request path behind both faces (gRPC and the OpenAI HTTP API).

`RequestPath` validates a `kvserve.v1.GenerateRequest` (the canonical request: the HTTP face
builds one from the OpenAI body), checks the frontend's limits, hands it to a runner
through the `Dispatcher`, and turns the runner's outputs into `Step`s: new token ids, their
text (detokenized, stop strings matched) and logprobs, then a last `Step` with the finish
reason and the usage. Refusals and failures are `Rejected` with a status name (gRPC's
spelling); each face maps it to its own status. Metrics and the running/waiting gauges are
kept here, so both faces count alike.

Knows the proto's request message, the tokenizer and the dispatcher; knows nothing about
gRPC servicers or HTTP.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.detok import TextStream
from kvserve.frontend.dispatch import Dispatcher, Failure, NoRunner, Pending, UserAbort
from kvserve.frontend.metrics import FrontendMetrics
from kvserve.frontend.validation import InvalidArgument, Prepared, prepare
from kvserve.messages.frontend_runner import ErrorCode, FinishReason, TokenLogprob, TokenOut
from kvserve.model.tokenizer import FrontendTokenizer
from kvserve.v1 import generator_pb2 as pb

DETOK_CONTEXT = 4  # prompt tokens seeding the detokenizer window
RUNNER_ERROR_CODES = {ErrorCode.INTERNAL: "INTERNAL", ErrorCode.INVALID_ARGUMENT: "INVALID_ARGUMENT"}
"""TokenOut.error_code -> status of the request; any other code (or "") is UNAVAILABLE."""


class Rejected(Exception):
    """A request refused or failed; `code` is a gRPC status name, str() says why (and names
    the field for INVALID_ARGUMENT, which then also sits in `field`)."""

    def __init__(self, code: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(slots=True)
class Usage:
    prompt: int
    cached: int = 0
    completion: int = 0


@dataclass(slots=True)
class Step:
    """What one runner output adds to a request; the last one has `finish_reason` and `usage`."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage | None = None


@dataclass(slots=True, eq=False)
class Call:
    """One admitted request."""

    request_id: str
    pending: Pending
    stream: TextStream
    usage: Usage
    arrival: float
    last: float  # when the previous output arrived
    first: bool = True  # no token streamed yet (the call counts as waiting)
    done: bool = False  # the runner is done with it (no abort needed)
    ended: bool = False  # a final Step or a Rejected was produced
    closed: bool = False  # `RequestPath.close` ran


class RequestPath:
    """Admits requests, streams their steps, and keeps the shared gauges and counters."""

    def __init__(self, cfg: FrontendConfig, tok: FrontendTokenizer, dispatcher: Dispatcher,
                 metrics: FrontendMetrics) -> None:
        self.cfg = cfg
        self.tok = tok
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.draining = False
        self.active = 0  # admitted requests not yet closed
        self.waiting = 0  # admitted requests that have not received their first token
        self.held = 0  # seats kept for choices not yet admitted (n > 1): counted as waiting ones

    def context_len(self) -> int:
        return self.dispatcher.router.context_len(self.tok.max_context_len)

    def reject(self, code: str, message: str, field: str = "") -> Rejected:
        """Count a failed request under `code` and return the exception to raise."""
        self.metrics.errors.labels(code=code).inc()
        return Rejected(code, message, field)

    def _gauges(self) -> None:
        self.metrics.running.set(self.active - self.waiting)
        self.metrics.waiting.set(self.waiting)

    async def prepare(self, request: pb.GenerateRequest) -> Prepared:
        """Validate and tokenize `request` off the event loop (tokenizing and the chat template
        take milliseconds to seconds; meanwhile the loop streams every other request)."""
        if self.draining:
            raise self.reject("UNAVAILABLE", "the server is shutting down")
        try:
            return await asyncio.to_thread(prepare, request, self.tok, self.cfg, self.context_len())
        except InvalidArgument as exc:
            raise self.reject("INVALID_ARGUMENT", str(exc), exc.field) from None

    def admit(self, request_id: str, prep: Prepared, arrival: float, seats: int = 1,
              held: bool = False) -> Call:
        """Check the limits and hand the request to a runner; `Rejected` when it cannot run.
        `seats`: streams the request will need (n choices): all must fit now, and the other
        `seats - 1` are held for it until admitted with `held` or given back by `release`."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.dispatcher.pending:
            raise self.reject("INVALID_ARGUMENT", f"request_id: {request_id!r} is already in use by a "
                                                  "running request", "request_id")
        if not held:
            if self.active + self.held + seats > self.cfg.max_concurrent_streams:
                raise self.reject("RESOURCE_EXHAUSTED",
                                  f"too many concurrent streams (limit {self.cfg.max_concurrent_streams})")
            if self.waiting + self.held + seats > self.cfg.max_waiting:
                raise self.reject("RESOURCE_EXHAUSTED",
                                  f"the waiting queue is full ({self.cfg.max_waiting} requests)")
        try:
            pending = self.dispatcher.submit(request_id, prep.prompt_ids, prep.params)
        except NoRunner:
            raise self.reject("UNAVAILABLE", "no live runner; try again later") from None
        self.metrics.prompt_tokens.inc(len(prep.prompt_ids))
        self.held += -1 if held else seats - 1
        self.active += 1
        self.waiting += 1
        self._gauges()
        return Call(request_id=request_id, pending=pending, arrival=arrival, last=arrival,
                    stream=TextStream.create(self.tok, prep.stops, prep.prompt_ids[-DETOK_CONTEXT:]),
                    usage=Usage(prompt=len(prep.prompt_ids)))

    def release(self, seats: int) -> None:
        """Give back `seats` held by `admit` that no choice will take."""
        self.held -= seats

    async def start(self, request: pb.GenerateRequest) -> Call:
        """`prepare` then `admit`."""
        arrival = time.monotonic()
        prep = await self.prepare(request)
        return self.admit(request.request_id, prep, arrival)

    def close(self, call: Call) -> None:
        """The face is done with `call` (finished, failed, or its client went away: then the
        runner is told to abort and the request counts as aborted). Idempotent."""
        if call.closed:
            return
        call.closed = True
        if not call.done:
            self.dispatcher.abort(call.pending)
            call.done = True
        if not call.ended:
            call.ended = True
            self.metrics.requests.labels(finish_reason=FinishReason.ABORT).inc()
        self.active -= 1
        if call.first:
            self.waiting -= 1
        self._gauges()

    async def steps(self, call: Call) -> AsyncIterator[Step]:
        """One `Step` per runner output until the request finishes, stops or is aborted;
        `Rejected` when it fails."""
        stream = call.stream
        while True:
            event = await self._next_event(call)
            if isinstance(event, Failure):
                call.ended = True
                raise self.reject(event.code, event.message)
            if isinstance(event, UserAbort):
                self.dispatcher.abort(call.pending)
                call.done = True
                yield self._final(call, [], [], stream.finish(), FinishReason.ABORT, timed=False)
                return
            out = event
            if out.finish_reason == FinishReason.ERROR:
                call.ended = True
                raise self.reject(RUNNER_ERROR_CODES.get(out.error_code, "UNAVAILABLE"),
                                  f"the runner failed the request: {out.error or 'unknown error'}")
            self._observe(call, out)
            text, stopped = stream.push(out.token_ids)
            if stopped:
                self.dispatcher.abort(call.pending)
                call.done = True
                yield self._final(call, out.token_ids, out.logprobs, text, FinishReason.STOP)
                return
            if out.finish_reason:
                self.dispatcher.finish(call.pending)
                call.done = True
                yield self._final(call, out.token_ids, out.logprobs, text + stream.finish(), out.finish_reason)
                return
            yield Step(out.token_ids, text, out.logprobs)

    async def _next_event(self, call: Call) -> TokenOut | Failure | UserAbort:
        """The request's next event; a `Failure` once no output came for the configured
        inactivity timeout (so no call waits forever on a runner that went quiet)."""
        limit = self.cfg.request_inactivity_timeout_s
        if not limit:
            return await call.pending.queue.get()
        try:
            async with asyncio.timeout(limit):
                return await call.pending.queue.get()
        except TimeoutError:
            runner = call.pending.runner_id or "no runner"
            return Failure(f"no output for {limit:g} s (request_inactivity_timeout_s) from {runner}")

    def _observe(self, call: Call, out: TokenOut) -> None:
        """Latency and token metrics of one runner output; the call's usage."""
        now = time.monotonic()
        if call.first and out.token_ids:
            call.first = False
            self.waiting -= 1
            self._gauges()
            self.metrics.ttft.observe(now - call.arrival)
            if out.queue_time > 0:
                self.metrics.queue_time.observe(out.queue_time)
        elif out.token_ids:
            self.metrics.itl.observe((now - call.last) / len(out.token_ids))
        call.last = now
        call.usage.cached = max(call.usage.cached, out.cached_tokens)
        call.usage.completion += len(out.token_ids)
        self.metrics.generation_tokens.inc(len(out.token_ids))

    def _final(self, call: Call, token_ids: list[int], logprobs: list[TokenLogprob], text: str,
               reason: str, timed: bool = True) -> Step:
        call.ended = True
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.cached_prompt_tokens.inc(call.usage.cached)
        if timed:
            self.metrics.e2e.observe(time.monotonic() - call.arrival)
        return Step(token_ids, text, logprobs, finish_reason=reason, usage=call.usage)
