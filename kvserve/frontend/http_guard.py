"""ASGI middleware in front of the HTTP face: the bearer token, the request body size limit
and the number of requests in progress, all answered before the app sees the request.

Knows ASGI and the frontend's config; nothing about routes, OpenAI shapes or runners (it
writes its errors through the callable the face gives it).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.config.frontend import FrontendConfig

OPEN_PATHS = ("/health",)
"""Served without the bearer token: routers poll /health without credentials."""


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
