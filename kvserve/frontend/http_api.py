"""The OpenAI-compatible HTTP face of the frontend (FastAPI, served by uvicorn on the
frontend's event loop beside grpc.aio).

Endpoints: GET /v1/models, POST /v1/completions and /v1/chat/completions (JSON or
server-sent events), their /render twins (the token ids a router hashes), POST /tokenize and
/detokenize (vLLM's shapes), GET /health and /version. Each generation request becomes a
`kvserve.v1.GenerateRequest` and runs on the same `RequestPath` as a gRPC call: one set of
checks, limits, metrics and runners behind both faces. Errors are OpenAI error objects
(`{"error": {"message", "type", "param", "code"}}`) whose param names the OpenAI field.

The routes and handlers are here; beside them are `http_request` (the bodies as proto
messages), `http_stream` (the response shapes, server-sent events), `http_errors` (the
error objects and status codes) and `http_guard` (token, body size and in-flight limits).

Knows HTTP, the OpenAI shapes and the proto's request message; nothing about runners.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.http_choices import MAX_N, Choices
from kvserve.frontend.http_errors import (
    HTTPError,
    _grpc_name,
    _rejected,
    _unsupported,
    _validation_error,
    error_body,
)
from kvserve.frontend.http_fields import check_extra
from kvserve.frontend.http_guard import _Guard
from kvserve.frontend.http_request import _chat, _prompts, _sampling
from kvserve.frontend.http_stream import (
    SSE_DONE,
    _ChatFormat,
    _CompletionFormat,
    _encode,
    _EventStream,
    _Format,
    _unless_disconnected,
    _usage,
)
from kvserve.frontend.http_structured import LEGACY_NAMES, constraint
from kvserve.frontend.http_tools import ToolPlan, ToolReplies, chat_tools, tool_family
from kvserve.frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Sampling,
)
from kvserve.frontend.requests import Rejected, RequestPath, Step
from kvserve.frontend.validation import MAX_LOGPROBS, InvalidArgument, check_ids, prompt_ids
from kvserve.v1 import generator_pb2 as pb

log = logging.getLogger("kvserve.frontend")



class OpenAIFace:
    """The handlers, on one `RequestPath`; `app` is the FastAPI application."""

    def __init__(self, cfg: FrontendConfig, path: RequestPath, served_model_name: str, token: str = "",
                 on_ignored: Callable[[str], None] = lambda field: None) -> None:
        self.cfg = cfg
        self.token = token
        self.path = path
        self.tok = path.tok
        self.model = served_model_name
        self.created = int(time.time())
        self.instance_id = f"{served_model_name}-{uuid.uuid4().hex[:12]}"  # unique per incarnation
        self._on_ignored = on_ignored
        self.tool_family, self.tool_marker_id = tool_family(cfg.tool_call_parser, path.tok)
        self._warned: set[str] = set()
        self.app = self._build()

    # -- plumbing ---------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(title="kvserve", version=__version__, openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(HTTPError)
        async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
            return self._error(exc.status, str(exc), exc.param, exc.code, count=not exc.counted)

        @app.exception_handler(StarletteHTTPException)
        async def starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            message = f"{request.method} {request.url.path}: {exc.detail}"
            return self._error(exc.status_code, message, None, None)

        for method, route, handler in (
                ("GET", "/health", self.health), ("GET", "/version", self.version),
                ("GET", "/get_server_info", self.server_info), ("GET", "/kv_event_sources", self.kv_event_sources),
                ("GET", "/v1/models", self.models), ("POST", "/v1/completions", self.completions),
                ("POST", "/v1/chat/completions", self.chat_completions),
                ("POST", "/v1/completions/render", self.render_completion),
                ("POST", "/v1/chat/completions/render", self.render_chat),
                ("POST", "/tokenize", self.tokenize), ("POST", "/detokenize", self.detokenize)):
            app.add_api_route(route, handler, methods=[method], response_model=None)
        return _Guard(app, self.cfg, self.token, self._error)  # type: ignore[return-value]

    def _error(self, status: int, message: str, param: str | None, code: str | None,
               count: bool = True) -> JSONResponse:
        if count:
            self.path.metrics.errors.labels(code=_grpc_name(status)).inc()
        return JSONResponse(error_body(status, message, param, code), status_code=status)

    async def _parse(self, request: Request, model: type[pydantic.BaseModel]) -> Any:
        try:
            body = model.model_validate_json(await request.body())
        except pydantic.ValidationError as exc:
            raise _validation_error(exc) from None
        if getattr(body, "model", None) not in (None, self.model):
            raise HTTPError(404, f"model: {body.model!r} is not served here (this server serves "
                                 f"{self.model!r})", "model", "model_not_found")
        for name, value in (body.model_extra or {}).items():
            if name in LEGACY_NAMES:  # honoured: http_structured reads them
                continue
            label = check_extra(name, value)  # an HTTPError where the value asks for what kvserve does not do
            self._on_ignored(label)
            if name not in self._warned and len(self._warned) < 256:
                self._warned.add(name)
                log.warning("ignoring the request field %r (kvserve does not use it)", name)
        return body

    # -- small endpoints --------------------------------------------------------------------

    async def health(self) -> Response:
        if self.path.draining:
            raise HTTPError(503, "the server is shutting down", None, "unavailable")
        if not self.path.dispatcher.router.live():
            raise HTTPError(503, "no live runner", None, "unavailable")
        return Response(status_code=200)

    async def version(self) -> dict:
        return {"version": __version__}

    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "kvserve",
            "root": self.tok.name, "parent": None, "max_model_len": self.path.context_len(),
        }]}

    async def server_info(self) -> dict:
        """What a router's KV-aware discovery reads: the model identity, this incarnation, the
        block size of the KV events."""
        # kv_block_size only: vllm-router reads "block_size" as its alias and refuses both at once
        return {"model_id": self.model, "model_path": self.tok.name, "instance_id": self.instance_id,
                "kv_block_size": self.cfg.kv_event_block_size, "max_model_len": self.path.context_len(),
                "version": __version__}

    async def kv_event_sources(self) -> dict:
        """memsvc's KV-event sockets, keyed by data-parallel rank ({} when not published)."""
        if not self.cfg.kv_events_endpoint:
            return {}
        return {"0": {"endpoint": self.cfg.kv_events_endpoint, "replay_endpoint": self.cfg.kv_events_replay_endpoint,
                      "topic": "", "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
                      "enable_kv_cache_events": True, "block_size": self.cfg.kv_event_block_size}}

    async def tokenize(self, request: Request) -> dict:
        body: TokenizeRequest = await self._parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "prompt: give exactly one of prompt and messages", "prompt", "invalid_value")
        req = pb.TokenizeRequest()
        if body.prompt is not None:
            req.text = body.prompt
        else:
            req.chat.CopyFrom(_chat(body.messages or [], body.add_generation_prompt))
        ids = await self._ids(prompt_ids, req, "input", body.messages is not None)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.path.context_len()}

    async def detokenize(self, request: Request) -> dict:
        body: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        try:
            check_ids(body.tokens, self.tok.vocab_size, "tokens")
        except InvalidArgument as exc:
            raise HTTPError(400, str(exc), exc.field, "invalid_value") from None
        return {"prompt": await asyncio.to_thread(self.tok.decode, body.tokens)}

    async def _ids(self, fn: Callable, req: Any, oneof: str, chat: bool) -> list[int]:
        try:
            return await asyncio.to_thread(fn, req, self.tok, self.cfg, oneof)
        except InvalidArgument as exc:
            raise _rejected(Rejected("INVALID_ARGUMENT", str(exc), exc.field), chat) from None

    # -- render: the ids a request will prefill, for routers --------------------------------

    async def render_completion(self, request: Request) -> dict | list:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        prompts = _prompts(body)
        rendered = [{"token_ids": await self._ids(prompt_ids, p, "prompt", False)} for p in prompts]
        return rendered[0] if len(rendered) == 1 else rendered

    async def render_chat(self, request: Request) -> dict:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        req = pb.GenerateRequest(chat=_chat(body.messages, body.add_generation_prompt))
        req.chat.tools.extend(chat_tools(body))
        return {"token_ids": await self._ids(prompt_ids, req, "prompt", True)}

    # -- generation -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        self._refuse_common(body)
        if body.echo and body.logprobs is not None:
            raise _unsupported("echo", "echo with logprobs (the prompt's own logprobs)")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of > 1")
        if body.suffix:
            raise _unsupported("suffix", "suffix")
        prompts = _prompts(body)
        if len(prompts) != 1:
            raise HTTPError(400, f"prompt: {len(prompts)} prompts in one request; kvserve takes one per "
                                 "request (send them as separate requests)", "prompt", "unsupported")
        top = body.logprobs
        if top is not None and top > MAX_LOGPROBS:
            raise HTTPError(400, f"logprobs: must be in 0..{MAX_LOGPROBS}, got {top}", "logprobs", "invalid_value")
        req = prompts[0]
        req.sampling.CopyFrom(_sampling(body, body.max_tokens, 0 if top is None else max(top, 1)))
        fmt = _CompletionFormat(self, "cmpl-", top)
        if body.echo:
            fmt.echo = req.text if req.HasField("text") else await asyncio.to_thread(self.tok.decode,
                                                                                    list(req.token_ids.ids))
        return await self._generate(request, req, body, fmt, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._refuse_common(body)
        plan = ToolPlan.of(body, self.tool_family, self.tool_marker_id, self.cfg.tool_call_parser)
        if body.continue_final_message:
            raise _unsupported("continue_final_message", "continue_final_message")
        if body.echo:
            raise _unsupported("echo", "echo on a chat (the last message prepended to the reply)")
        if body.top_logprobs and not body.logprobs:
            raise HTTPError(400, "top_logprobs: needs logprobs set to true", "top_logprobs", "invalid_value")
        top = (body.top_logprobs or 0) if body.logprobs else None
        if top is not None and top > MAX_LOGPROBS:
            raise HTTPError(400, f"top_logprobs: must be in 0..{MAX_LOGPROBS}, got {top}", "top_logprobs",
                            "invalid_value")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = pb.GenerateRequest(chat=_chat(body.messages, body.add_generation_prompt))
        req.chat.tools.extend(chat_tools(body))
        req.sampling.CopyFrom(_sampling(body, max_tokens, 0 if top is None else max(top, 1)))
        fmt = _ChatFormat(self, "chatcmpl-", top)
        if plan is not None:
            fmt.tools = ToolReplies(plan)
        forced = None if plan is None or plan.constraint is None else ("tools", plan.constraint)
        return await self._generate(request, req, body, fmt, chat=True, forced=forced)

    @staticmethod
    def _refuse_common(body: _Sampling) -> None:
        if not 1 <= body.n <= MAX_N:
            raise HTTPError(400, f"n: must be in 1..{MAX_N}, got {body.n}", "n", "invalid_value")

    async def _generate(self, request: Request, req: pb.GenerateRequest, body: _Sampling, fmt: _Format,
                        chat: bool, forced: tuple[str, pb.Constraint] | None = None) -> Response:
        req.request_id = request.headers.get("x-request-id", "") or fmt.id
        opts = body.stream_options  # checked before anything is admitted
        if opts is not None and opts.model_extra:
            raise _unsupported(f"stream_options.{next(iter(opts.model_extra))}", "this stream option")
        asked = constraint(body)
        if forced is not None:  # the tools' grammar: the reply must be calls
            if asked is not None:
                raise HTTPError(400, f"{asked[0]}: a structured output cannot be asked beside tool_choice "
                                     "required, a named function or a strict tool", asked[0], "invalid_value")
            asked = forced
        if asked is not None:
            req.sampling.constraint.CopyFrom(asked[1])
        arrival = time.monotonic()
        try:
            prep = await self.path.prepare(req)
            seats = min(self.cfg.max_concurrent_streams, self.cfg.max_waiting)
            if body.n > seats:
                raise self.path.reject("INVALID_ARGUMENT", f"n: {body.n} choices is more than the {seats} "
                                       "streams this server admits at once (max_concurrent_streams, "
                                       "max_waiting)", "n")
            first = self.path.admit(req.request_id, prep, arrival, seats=body.n)
        except Rejected as exc:
            if asked is not None and exc.field.startswith("sampling.constraint"):  # named as the client did
                exc = Rejected(exc.code, asked[0] + str(exc)[len(exc.field):], asked[0])
            raise _rejected(exc, chat) from None
        choices = Choices(self.path, first, prep, req.request_id, body.n, arrival)
        fmt.n = body.n
        include_usage = bool(opts and opts.include_usage)
        fmt.running_usage = bool(opts and opts.continuous_usage_stats)
        if body.stream:
            return _EventStream(self._events(choices, fmt, include_usage, chat), choices.close)
        return await _unless_disconnected(request, self._whole(choices, fmt, chat))

    async def _events(self, choices: Choices, fmt: _Format, include_usage: bool,
                      chat: bool) -> AsyncIterator[bytes]:
        try:
            yield fmt.first_event()
            async for index, step in choices.steps():
                if step.text or step.finish_reason or fmt.every_step:
                    for chunk in fmt.chunks(step, index):
                        if fmt.running_usage:
                            chunk["usage"] = _usage(choices.usage())
                        yield b"data: " + _encode(chunk) + b"\n\n"
            if include_usage:
                yield b"data: " + _encode(fmt.usage_chunk(choices.usage())) + b"\n\n"
        except Rejected as exc:
            err = _rejected(exc, chat)
            yield b"data: " + _encode(error_body(err.status, str(err), err.param, err.code)) + b"\n\n"
        finally:
            choices.close()
        yield SSE_DONE

    async def _whole(self, choices: Choices, fmt: _Format, chat: bool) -> Response:
        steps: list[list[Step]] = [[] for _ in range(choices.n)]
        try:
            async for index, step in choices.steps():
                steps[index].append(step)
        except Rejected as exc:
            raise _rejected(exc, chat) from None
        finally:
            choices.close()
        return Response(_encode(fmt.whole(steps, choices.usage())), media_type="application/json")
