"""The `kvserve.v1.Generator` gRPC service: validate, route, detokenize, stream, cancel.

One `GeneratorService` per frontend process. It turns each `Generate` call into a
`GenerateReq` through the `Dispatcher`, streams one `GenerateResponse` per runner step
(text deltas from `TextStream`, stop strings matched here), and sends `AbortReq` as soon
as the call ends early (client cancel, deadline, stop string, `Abort` RPC).

Knows gRPC and the proto; knows nothing about ZMQ framing or process management.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.requests import Rejected, RequestPath, Step
from kvserve.frontend.validation import InvalidArgument, prompt_ids
from kvserve.messages.frontend_runner import TokenLogprob
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc


def _logprobs(token_ids: list[int], logprobs: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=tid, logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=False)],
        )
        for tid, lp in zip(token_ids, logprobs, strict=False)
    ]


def _response(request_id: str, step: Step) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id, token_ids=step.token_ids, text=step.text,
                                   logprobs=_logprobs(step.token_ids, step.logprobs),
                                   finish_reason=step.finish_reason)
    if step.usage is not None:
        response.usage.CopyFrom(pb.Usage(prompt_tokens=step.usage.prompt, cached_tokens=step.usage.cached,
                                         completion_tokens=step.usage.completion))
    return response


class GeneratorService(pb_grpc.GeneratorServicer):
    """Implements every RPC of `kvserve.v1.Generator` on the shared `RequestPath`."""

    def __init__(self, cfg: FrontendConfig, path: RequestPath) -> None:
        self.cfg = cfg
        self.path = path
        self.tok = path.tok
        self.dispatcher = path.dispatcher
        self.metrics = path.metrics

    async def _fail(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.errors.labels(code=code.name).inc()
        await context.abort(code, message)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            call = await self.path.start(request)
        except Rejected as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        try:
            async for step in self.path.steps(call):
                yield _response(call.request_id, step)
        except Rejected as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        finally:
            self.path.close(call)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(
            name=self.tok.name, vocab_size=self.tok.vocab_size,
            max_context_len=self.path.context_len(),
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
        return pb.LoadReport(running=self.path.active - self.path.waiting, waiting=self.path.waiting,
                             runners=runners)
