"""The OpenAI-compatible HTTP face of the frontend (FastAPI, served by uvicorn on the
frontend's event loop beside grpc.aio).

Endpoints: GET /v1/models, POST /v1/completions and /v1/chat/completions (JSON or
server-sent events), their /render twins (the token ids a router hashes), POST /tokenize and
/detokenize (vLLM's shapes), GET /health and /version. Each generation request becomes a
`kvserve.v1.GenerateRequest` and runs on the same `RequestPath` as a gRPC call: one set of
checks, limits, metrics and runners behind both faces. Errors are OpenAI error objects
(`{"error": {"message", "type", "param", "code"}}`) whose param names the OpenAI field.

Knows HTTP, the OpenAI shapes and the proto's request message; nothing about runners.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any

import msgspec
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve import __version__
from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Sampling,
)
from kvserve.frontend.requests import Call, Rejected, RequestPath, Step, Usage
from kvserve.frontend.validation import MAX_LOGPROBS, InvalidArgument, check_ids, prompt_ids
from kvserve.messages.frontend_runner import TokenLogprob
from kvserve.v1 import generator_pb2 as pb

log = logging.getLogger("kvserve.frontend")

OPEN_PATHS = ("/health",)
"""Served without the bearer token: routers poll /health without credentials."""
STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
          "INTERNAL": 500, "UNAVAILABLE": 503}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
KNOWN_IGNORED = frozenset((
    "echo", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "return_hidden_states",
    "separate_reasoning", "stream_reasoning", "include_reasoning", "include_stop_str_in_output",
    "add_special_tokens", "priority", "truncate_prompt_tokens", "user", "metadata", "store",
    "chat_template_kwargs", "documents", "lora_path", "lora_name", "cache_salt", "min_tokens",
    "length_penalty", "use_beam_search", "detokenize", "request_id", "parallel_tool_calls",
    "tool_choice", "service_tier", "regex", "json_schema", "ebnf", "session_params", "rid",
))
"""Fields kvserve does not use, counted under their own name; any other counts as "other"."""
SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


class HTTPError(Exception):
    """An answer other than 200: the status, and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 counted: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.counted = counted  # already in kvserve_request_errors_total (the request path counted it)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def _param(field: str, chat: bool) -> str:
    """The OpenAI name of a field that validation named by its proto path."""
    if field.startswith("sampling."):
        rest = field[len("sampling."):]
        if rest.startswith("max_new_tokens"):
            return "max_completion_tokens" if chat else "max_tokens"
        if rest.startswith("logprobs"):
            return "top_logprobs" if chat else "logprobs"
        return rest
    for proto, http in (("prompt.chat.messages", "messages"), ("input.chat.messages", "messages"),
                        ("prompt.chat", "messages"), ("input.chat", "messages"),
                        ("prompt.token_ids", "prompt"), ("prompt.text", "prompt"), ("input.text", "prompt")):
        if field.startswith(proto):
            return http + field[len(proto):]
    if field in ("prompt", "input"):
        return "messages" if chat else "prompt"
    return field


def _rejected(exc: Rejected, chat: bool) -> HTTPError:
    message = str(exc)
    param = None
    if exc.field:
        param = _param(exc.field, chat)
        if message.startswith(exc.field + ":"):
            message = param + message[len(exc.field):]
    return HTTPError(STATUS.get(exc.code, 500), message, param, exc.code.lower(), counted=True)


def _validation_error(exc: pydantic.ValidationError) -> HTTPError:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return HTTPError(400, f"malformed JSON body: {err['ctx']['error']}", None, "invalid_json")
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or not _is_union_tag(str(p))]
    if not loc:
        return HTTPError(400, "the body must be a JSON object", None, "invalid_body")
    param = loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:])
    return HTTPError(400, f"{param}: {err['msg']}", param, "invalid_value")


def _is_union_tag(part: str) -> bool:
    """Pydantic names the union member it tried inside an error's location (`list[int]`, `str`)."""
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "TextPart")


def _unsupported(param: str, what: str) -> HTTPError:
    return HTTPError(400, f"{param}: {what} is not supported by kvserve", param, "unsupported")


def _sampling(body: _Sampling, max_tokens: int | None, logprobs: int) -> pb.SamplingParams:
    """The OpenAI/vLLM sampling fields as kvserve's (range checks come later, in validation)."""
    s = pb.SamplingParams(stop=body.stops(), stop_token_ids=body.stop_token_ids or [],
                          ignore_eos=body.ignore_eos, logprobs=logprobs)
    s.temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if body.top_k is not None:
        s.top_k = max(body.top_k, 0)  # vLLM spells "off" -1, kvserve 0
    if body.seed is not None:
        s.seed = body.seed % 2**64
    if max_tokens is not None:
        s.max_new_tokens = max_tokens
    return s


def _chat(messages: list, add_generation_prompt: bool) -> pb.Chat:
    chat = pb.Chat(add_generation_prompt=add_generation_prompt)
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, dict):  # a part of another type (image, audio, ...)
                    raise _unsupported(f"messages[{i}].content[{j}]", f"a content part of type "
                                                                      f"{part.get('type')!r}")
                texts.append(part.text)
            content = "\n".join(texts)
        chat.messages.add(role="system" if m.role == "developer" else m.role, content=content or "")
    return chat


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.prompt + u.completion,
            "prompt_tokens_details": {"cached_tokens": u.cached}}


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
        for name in body.model_extra or ():
            label = name if name in KNOWN_IGNORED else "other"
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
        prompts = self._prompts(body)
        rendered = [{"token_ids": await self._ids(prompt_ids, p, "prompt", False)} for p in prompts]
        return rendered[0] if len(rendered) == 1 else rendered

    async def render_chat(self, request: Request) -> dict:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        req = pb.GenerateRequest(chat=_chat(body.messages, body.add_generation_prompt))
        return {"token_ids": await self._ids(prompt_ids, req, "prompt", True)}

    @staticmethod
    def _prompts(body: CompletionRequest) -> list[pb.GenerateRequest]:
        p = body.prompt
        if isinstance(p, str):
            return [pb.GenerateRequest(text=p)]
        if not p or isinstance(p[0], int):
            return [pb.GenerateRequest(token_ids=pb.TokenIds(ids=p))]  # type: ignore[arg-type]
        return [pb.GenerateRequest(text=x) if isinstance(x, str) else pb.GenerateRequest(token_ids=pb.TokenIds(ids=x))
                for x in p]

    # -- generation -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        self._refuse_common(body)
        if body.echo:
            raise _unsupported("echo", "echo")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of > 1")
        if body.suffix:
            raise _unsupported("suffix", "suffix")
        prompts = self._prompts(body)
        if len(prompts) != 1:
            raise HTTPError(400, f"prompt: {len(prompts)} prompts in one request; kvserve takes one per "
                                 "request (send them as separate requests)", "prompt", "unsupported")
        top = body.logprobs
        if top is not None and top > MAX_LOGPROBS:
            raise HTTPError(400, f"logprobs: must be in 0..{MAX_LOGPROBS}, got {top}", "logprobs", "invalid_value")
        req = prompts[0]
        req.sampling.CopyFrom(_sampling(body, body.max_tokens, 0 if top is None else max(top, 1)))
        fmt = _CompletionFormat(self, "cmpl-", top)
        return await self._generate(request, req, body, fmt, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._refuse_common(body)
        if body.tools:
            raise _unsupported("tools", "tool calling")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise _unsupported("response_format", f"response_format {body.response_format.get('type')!r}")
        if body.continue_final_message:
            raise _unsupported("continue_final_message", "continue_final_message")
        if body.top_logprobs and not body.logprobs:
            raise HTTPError(400, "top_logprobs: needs logprobs set to true", "top_logprobs", "invalid_value")
        top = (body.top_logprobs or 0) if body.logprobs else None
        if top is not None and top > MAX_LOGPROBS:
            raise HTTPError(400, f"top_logprobs: must be in 0..{MAX_LOGPROBS}, got {top}", "top_logprobs",
                            "invalid_value")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = pb.GenerateRequest(chat=_chat(body.messages, body.add_generation_prompt))
        req.sampling.CopyFrom(_sampling(body, max_tokens, 0 if top is None else max(top, 1)))
        fmt = _ChatFormat(self, "chatcmpl-", top)
        return await self._generate(request, req, body, fmt, chat=True)

    @staticmethod
    def _refuse_common(body: _Sampling) -> None:
        if body.n != 1:
            raise HTTPError(400, f"n: only n=1 is supported, got {body.n} (send n requests instead)", "n",
                            "unsupported")
        if body.logit_bias:
            raise _unsupported("logit_bias", "logit_bias")

    async def _generate(self, request: Request, req: pb.GenerateRequest, body: _Sampling, fmt: _Format,
                        chat: bool) -> Response:
        req.request_id = request.headers.get("x-request-id", "") or fmt.id
        try:
            call = await self.path.start(req)
        except Rejected as exc:
            raise _rejected(exc, chat) from None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return _EventStream(self._events(call, fmt, include_usage, chat), lambda: self.path.close(call))
        return await _unless_disconnected(request, self._whole(call, fmt, chat))

    async def _events(self, call: Call, fmt: _Format, include_usage: bool, chat: bool) -> AsyncIterator[bytes]:
        try:
            yield fmt.first_event()
            async for step in self.path.steps(call):
                if step.text or step.finish_reason or fmt.top is not None:
                    yield b"data: " + _encode(fmt.chunk(step)) + b"\n\n"
                if step.usage is not None and include_usage:
                    yield b"data: " + _encode(fmt.usage_chunk(step.usage)) + b"\n\n"
        except Rejected as exc:
            err = _rejected(exc, chat)
            yield b"data: " + _encode(error_body(err.status, str(err), err.param, err.code)) + b"\n\n"
        finally:
            self.path.close(call)
        yield SSE_DONE

    async def _whole(self, call: Call, fmt: _Format, chat: bool) -> Response:
        steps: list[Step] = []
        try:
            async for step in self.path.steps(call):
                steps.append(step)
        except Rejected as exc:
            raise _rejected(exc, chat) from None
        finally:
            self.path.close(call)
        return Response(_encode(fmt.whole(steps)), media_type="application/json")


# -- response shapes --------------------------------------------------------------------------


class _Format:
    """How one endpoint writes its chunks and its whole response."""

    object_name = ""

    def __init__(self, face: OpenAIFace, prefix: str, top: int | None) -> None:
        self.face = face
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.top = top  # None: no logprobs; else the number of alternatives per token
        self._offset = 0

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.face.model}

    def _token(self, tid: int) -> str:
        return self.face.tok.decode([tid])

    def first_event(self) -> bytes:
        return b""

    def usage_chunk(self, usage: Usage) -> dict:
        return self._head(self.chunk_object) | {"choices": [], "usage": _usage(usage)}

    chunk_object = ""

    def chunk(self, step: Step) -> dict:
        raise NotImplementedError

    def whole(self, steps: list[Step]) -> dict:
        raise NotImplementedError


class _CompletionFormat(_Format):
    chunk_object = "text_completion"

    def _logprobs(self, token_ids: list[int], lps: list[TokenLogprob], text: str) -> dict | None:
        if self.top is None:
            return None
        tokens = [self._token(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(i): v for i, v in zip(lp.top_ids[:self.top], lp.top_logprobs,
                                                                      strict=False)} for lp in lps],
                "text_offset": offsets}

    def chunk(self, step: Step) -> dict:
        return self._head("text_completion") | {"choices": [{
            "index": 0, "text": step.text, "logprobs": self._logprobs(step.token_ids, step.logprobs, step.text),
            "finish_reason": step.finish_reason or None}]}

    def whole(self, steps: list[Step]) -> dict:
        last = steps[-1]
        ids = [t for s in steps for t in s.token_ids]
        lps = [lp for s in steps for lp in s.logprobs]
        return self._head("text_completion") | {
            "choices": [{"index": 0, "text": "".join(s.text for s in steps),
                         "logprobs": self._logprobs(ids, lps, ""), "finish_reason": last.finish_reason}],
            "usage": _usage(last.usage or Usage(0)),
        }


class _ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, token_ids: list[int], lps: list[TokenLogprob]) -> dict | None:
        if self.top is None:
            return None

        def entry(tid: int, logprob: float) -> dict:
            token = self._token(tid)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [entry(t, lp.logprob) | {"top_logprobs": [
            entry(i, v) for i, v in zip(lp.top_ids[:self.top], lp.top_logprobs, strict=False)]}
            for t, lp in zip(token_ids, lps, strict=False)]}

    def first_event(self) -> bytes:
        head = self._head(self.chunk_object) | {"choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        return b"data: " + _encode(head) + b"\n\n"

    def chunk(self, step: Step) -> dict:
        return self._head(self.chunk_object) | {"choices": [{
            "index": 0, "delta": {"content": step.text} if step.text else {},
            "logprobs": self._logprobs(step.token_ids, step.logprobs), "finish_reason": step.finish_reason or None}]}

    def whole(self, steps: list[Step]) -> dict:
        last = steps[-1]
        ids = [t for s in steps for t in s.token_ids]
        lps = [lp for s in steps for lp in s.logprobs]
        return self._head("chat.completion") | {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(s.text for s in steps)},
                         "logprobs": self._logprobs(ids, lps), "finish_reason": last.finish_reason}],
            "usage": _usage(last.usage or Usage(0)),
        }


# -- transport helpers ------------------------------------------------------------------------


class _EventStream(StreamingResponse):
    """Server-sent events that always release their request, even when the client left before
    the first event (then the generator never ran, and its own cleanup with it)."""

    def __init__(self, events: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            with suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _unless_disconnected(request: Request, work: Any) -> Response:
    """Await `work`, cancelling it (and so aborting its request) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task  # its cleanup aborts the request
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it: the client is gone
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _grpc_name(status: int) -> str:
    """The gRPC status name an HTTP error counts under in kvserve_request_errors_total."""
    for name, code in STATUS.items():
        if code == status:
            return name
    return {413: "RESOURCE_EXHAUSTED", 405: "NOT_FOUND"}.get(status, "INTERNAL" if status >= 500 else
                                                             "INVALID_ARGUMENT")


class _Guard:
    """ASGI middleware in front of the app: the bearer token (not for /health), the body size
    limit (413, checked while reading, so a big body costs no memory past the limit) and the
    number of requests in progress (429)."""

    def __init__(self, app: ASGIApp, cfg: FrontendConfig, token: str,
                 error: Callable[[int, str, str | None, str | None], JSONResponse]) -> None:
        self.app = app
        self.cfg = cfg
        self.token = token.encode()
        self.error = error
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.token and scope["path"] not in OPEN_PATHS:
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, b"Bearer " + self.token):
                await self.error(401, "missing or wrong bearer token (Authorization: Bearer ...)", None,
                                 "invalid_api_key")(scope, receive, send)
                return
        if self.in_progress >= self.cfg.max_concurrent_rpcs:
            await self.error(429, f"too many requests in progress (limit {self.cfg.max_concurrent_rpcs}, "
                                  "max_concurrent_rpcs)", None, "overloaded")(scope, receive, send)
            return
        limit = self.cfg.max_message_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(int(declared), scope, receive, send)
            return
        self.in_progress += 1
        try:
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left before its body was in
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    await self._too_large(size, scope, receive, send)
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            await self.app(scope, _replay(b"".join(chunks), receive), send)
        finally:
            self.in_progress -= 1

    async def _too_large(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        await self.error(413, f"the request body has {size} bytes or more, more than the limit of "
                              f"{self.cfg.max_message_bytes} (max_message_bytes)", None,
                         "body_too_large")(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then waits on the client (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
