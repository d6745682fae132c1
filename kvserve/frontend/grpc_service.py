"""The `kvserve.v1.Generator` gRPC service: validate, route, detokenize, stream, cancel.

One `GeneratorService` per frontend process. It turns each `Generate` call into a
`GenerateReq` through the `Dispatcher`, streams one `GenerateResponse` per runner step
(text deltas from `TextStream`, stop strings matched here), and sends `AbortReq` as soon
as the call ends early (client cancel, deadline, stop string, `Abort` RPC).

Knows gRPC and the proto; knows nothing about ZMQ framing or process management.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.detok import TextStream
from kvserve.frontend.dispatch import Dispatcher, Failure, NoRunner, Pending, UserAbort
from kvserve.frontend.metrics import FrontendMetrics
from kvserve.frontend.validation import InvalidArgument, prepare, prompt_ids
from kvserve.messages.frontend_runner import ErrorCode, FinishReason, TokenOut
from kvserve.model.tokenizer import FrontendTokenizer
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

DETOK_CONTEXT = 4  # prompt tokens seeding the detokenizer window
RUNNER_ERROR_CODES = {ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
                      ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT}
"""TokenOut.error_code -> status of the call; any other code (or "") is UNAVAILABLE."""


@dataclass(slots=True)
class _Usage:
    prompt: int
    cached: int = 0
    completion: int = 0


@dataclass(slots=True, eq=False)
class _Call:
    """One open Generate call."""

    request_id: str
    pending: Pending
    stream: TextStream
    usage: _Usage
    arrival: float
    last: float  # when the previous output arrived
    first: bool = True  # no token streamed yet (the call counts as waiting)
    done: bool = False  # the runner is done with it (no abort needed)


def _logprobs(out: TokenOut) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=tid, logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=False)],
        )
        for tid, lp in zip(out.token_ids, out.logprobs, strict=False)
    ]


class GeneratorService(pb_grpc.GeneratorServicer):
    """Implements every RPC of `kvserve.v1.Generator`."""

    def __init__(self, cfg: FrontendConfig, tok: FrontendTokenizer, dispatcher: Dispatcher,
                 metrics: FrontendMetrics) -> None:
        self.cfg = cfg
        self.tok = tok
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.draining = False
        self.active = 0  # open Generate streams
        self.waiting = 0  # open streams that have not received their first token

    async def _fail(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.errors.labels(code=code.name).inc()
        await context.abort(code, message)

    def _gauges(self) -> None:
        self.metrics.running.set(self.active - self.waiting)
        self.metrics.waiting.set(self.waiting)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        call = await self._start(request, context)
        try:
            async for response in self._responses(call, context):
                yield response
        finally:
            if not call.done:
                self.dispatcher.abort(call.pending)
            self.active -= 1
            if call.first:
                self.waiting -= 1
            self._gauges()

    async def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> _Call:
        """Validate the call, check the limits and hand it to a runner (or fail the call)."""
        arrival = time.monotonic()
        if self.draining:
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        context_len = self.dispatcher.router.context_len(self.tok.max_context_len)
        try:
            # tokenizing and the chat template take milliseconds to seconds: off the event loop,
            # which meanwhile streams every other call's tokens
            prep = await asyncio.to_thread(prepare, request, self.tok, self.cfg, context_len)
        except InvalidArgument as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.dispatcher.pending:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"request_id: {request_id!r} is already in use by a running request")
        if self.active >= self.cfg.max_concurrent_streams:
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"too many concurrent streams (limit {self.cfg.max_concurrent_streams})")
        if self.waiting >= self.cfg.max_waiting:
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"the waiting queue is full ({self.cfg.max_waiting} requests)")
        try:
            pending = self.dispatcher.submit(request_id, prep.prompt_ids, prep.params)
        except NoRunner:
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, "no live runner; try again later")
        self.metrics.prompt_tokens.inc(len(prep.prompt_ids))
        self.active += 1
        self.waiting += 1
        self._gauges()
        return _Call(
            request_id=request_id, pending=pending, arrival=arrival, last=arrival,
            stream=TextStream.create(self.tok, prep.stops, prep.prompt_ids[-DETOK_CONTEXT:]),
            usage=_Usage(prompt=len(prep.prompt_ids)),
        )

    async def _responses(self, call: _Call,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """One response per runner output until the request finishes, stops or is aborted."""
        request_id, stream = call.request_id, call.stream
        while True:
            event = await self._next_event(call)
            if isinstance(event, Failure):
                await self._fail(context, grpc.StatusCode[event.code], event.message)
            if isinstance(event, UserAbort):
                self.dispatcher.abort(call.pending)
                call.done = True
                yield self._final(request_id, [], stream.finish(), FinishReason.ABORT, call.usage, None)
                return
            out = event
            if out.finish_reason == FinishReason.ERROR:
                await self._fail(context, RUNNER_ERROR_CODES.get(out.error_code, grpc.StatusCode.UNAVAILABLE),
                                 f"the runner failed the request: {out.error or 'unknown error'}")
            self._observe(call, out)
            text, stopped = stream.push(out.token_ids)
            if stopped:
                self.dispatcher.abort(call.pending)
                call.done = True
                yield self._final(request_id, out, text, FinishReason.STOP, call.usage, call.arrival)
                return
            if out.finish_reason:
                self.dispatcher.finish(call.pending)
                call.done = True
                yield self._final(request_id, out, text + stream.finish(), out.finish_reason, call.usage,
                                  call.arrival)
                return
            yield pb.GenerateResponse(request_id=request_id, token_ids=out.token_ids, text=text,
                                      logprobs=_logprobs(out))

    async def _next_event(self, call: _Call) -> TokenOut | Failure | UserAbort:
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

    def _observe(self, call: _Call, out: TokenOut) -> None:
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

    def _final(self, request_id: str, out: TokenOut | list, text: str, reason: str, usage: _Usage,
               arrival: float | None) -> pb.GenerateResponse:
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.cached_prompt_tokens.inc(usage.cached)
        if arrival is not None:
            self.metrics.e2e.observe(time.monotonic() - arrival)
        ids = out.token_ids if isinstance(out, TokenOut) else []
        lps = _logprobs(out) if isinstance(out, TokenOut) else []
        return pb.GenerateResponse(
            request_id=request_id, token_ids=ids, text=text, logprobs=lps, finish_reason=reason,
            usage=pb.Usage(prompt_tokens=usage.prompt, cached_tokens=usage.cached,
                           completion_tokens=usage.completion),
        )

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(
            name=self.tok.name, vocab_size=self.tok.vocab_size,
            max_context_len=self.dispatcher.router.context_len(self.tok.max_context_len),
            eos_token_ids=list(self.tok.eos_token_ids), has_chat_template=self.tok.has_chat_template,
            max_new_tokens_cap=self.cfg.max_new_tokens_cap,
        )

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            ids = await asyncio.to_thread(prompt_ids, request, self.tok, self.cfg, "input")
        except InvalidArgument as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        response = pb.TokenizeResponse(token_ids=ids)
        size = response.ByteSize()
        if size > self.cfg.max_send_message_bytes:
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"input: its {len(ids)} token ids take {size} bytes, more than the largest "
                             f"response of {self.cfg.max_send_message_bytes} (max_send_message_bytes)")
        return response

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        return pb.AbortResponse(aborted=self.dispatcher.user_abort(request.request_id))

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        runners = [
            pb.RunnerLoad(runner_id=st.runner_id, running=st.running, waiting=st.waiting,
                          kv_usage=st.kv_usage, live=True)
            for st in self.dispatcher.router.live()
        ]
        return pb.LoadReport(running=self.active - self.waiting, waiting=self.waiting, runners=runners)
