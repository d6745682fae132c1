"""The HTTP face's responses: the OpenAI completion and chat shapes (whole, or chunk by chunk
as server-sent events, with logprobs and usage), the event stream that always releases its
request, and the wait that aborts a request when its client disconnects.

Knows the OpenAI response shapes, SSE and ASGI; nothing about request bodies, routes or
runners (a format reads only the served model's name and tokenizer from its face).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.frontend.requests import Step, Usage
from kvserve.messages.frontend_runner import TokenLogprob

if TYPE_CHECKING:
    from kvserve.frontend.http_api import OpenAIFace
    from kvserve.frontend.http_tools import ToolReplies

SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.prompt + u.completion,
            "prompt_tokens_details": {"cached_tokens": u.cached}}


# -- response shapes --------------------------------------------------------------------------


class _Format:
    """How one endpoint writes its chunks and its whole response."""

    object_name = ""

    def __init__(self, face: OpenAIFace, prefix: str, top: int | None) -> None:
        self.face = face
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.top = top  # None: no logprobs; else the number of alternatives per token
        self.n = 1  # choices
        self.running_usage = False  # stream_options.continuous_usage_stats: the usage so far in every chunk
        self._offset: dict[int, int] = {}  # the text offset of each choice's next token

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.face.model}

    def _token(self, tid: int) -> str:
        return self.face.tok.decode([tid])

    def first_event(self) -> bytes:
        return b""

    def choices(self, per_choice: list[list[Step]]) -> list[dict]:
        return [self.choice(steps, i) for i, steps in enumerate(per_choice)]

    def whole(self, per_choice: list[list[Step]], usage: Usage) -> dict:
        return self._head(self.whole_object) | {"choices": self.choices(per_choice), "usage": _usage(usage)}

    whole_object = ""

    def choice(self, steps: list[Step], index: int) -> dict:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict:
        return self._head(self.chunk_object) | {"choices": [], "usage": _usage(usage)}

    chunk_object = ""

    def chunk(self, step: Step, index: int = 0) -> dict:
        raise NotImplementedError

    def chunks(self, step: Step, index: int = 0) -> list[dict]:
        return [self.chunk(step, index)]

    @property
    def every_step(self) -> bool:
        """Steps without text are formatted too (their logprobs, or a tool marker's token)."""
        return self.top is not None


class _CompletionFormat(_Format):
    chunk_object = "text_completion"
    whole_object = "text_completion"
    echo = ""  # the prompt's text, where the request asked for it back (echo)

    def first_event(self) -> bytes:
        if not self.echo:
            return b""
        return b"".join(b"data: " + _encode(self._head(self.chunk_object) | {"choices": [{
            "index": i, "text": self.echo, "logprobs": None, "finish_reason": None}]}) + b"\n\n"
            for i in range(self.n))

    def _logprobs(self, token_ids: list[int], lps: list[TokenLogprob], index: int) -> dict | None:
        if self.top is None:
            return None
        tokens = [self._token(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(self._offset.get(index, 0))
            self._offset[index] = offsets[-1] + len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(i): v for i, v in zip(lp.top_ids[:self.top], lp.top_logprobs,
                                                                      strict=False)} for lp in lps],
                "text_offset": offsets}

    def chunk(self, step: Step, index: int = 0) -> dict:
        return self._head("text_completion") | {"choices": [{
            "index": index, "text": step.text, "logprobs": self._logprobs(step.token_ids, step.logprobs, index),
            "finish_reason": step.finish_reason or None}]}

    def choice(self, steps: list[Step], index: int) -> dict:
        ids = [t for s in steps for t in s.token_ids]
        lps = [lp for s in steps for lp in s.logprobs]
        return {"index": index, "text": self.echo + "".join(s.text for s in steps),
                "logprobs": self._logprobs(ids, lps, index),
                "finish_reason": steps[-1].finish_reason}


class _ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"
    whole_object = "chat.completion"
    tools: ToolReplies | None = None  # replies read for tool calls

    @property
    def every_step(self) -> bool:
        return self.top is not None or self.tools is not None

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
        return b"".join(b"data: " + _encode(self._head(self.chunk_object) | {"choices": [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            + b"\n\n" for i in range(self.n))

    def _delta(self, index: int, delta: dict, logprobs: dict | None = None, reason: str | None = None) -> dict:
        return self._head(self.chunk_object) | {"choices": [{
            "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def chunk(self, step: Step, index: int = 0) -> dict:
        return self._delta(index, {"content": step.text} if step.text else {},
                           self._logprobs(step.token_ids, step.logprobs), step.finish_reason or None)

    def chunks(self, step: Step, index: int = 0) -> list[dict]:
        if self.tools is None:
            return [self.chunk(step, index)]
        content, calls = self.tools.step(index, step)
        lps = self._logprobs(step.token_ids, step.logprobs)
        out = [self._delta(index, {"content": content} if content else {}, lps)] if content or lps else []
        out += [self._delta(index, {"tool_calls": [d]}) for d in calls]
        if step.finish_reason:
            out.append(self._delta(index, {}, None, self.tools.finish_reason(index, step.finish_reason)))
        return out

    def choice(self, steps: list[Step], index: int) -> dict:
        ids = [t for s in steps for t in s.token_ids]
        lps = [lp for s in steps for lp in s.logprobs]
        reason = steps[-1].finish_reason
        if self.tools is not None:
            message = self.tools.message(index, steps)
            reason = self.tools.finish_reason(index, reason)
        else:
            message = {"role": "assistant", "content": "".join(s.text for s in steps)}
        return {"index": index, "message": message, "logprobs": self._logprobs(ids, lps), "finish_reason": reason}


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
