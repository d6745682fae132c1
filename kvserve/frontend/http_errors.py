"""The HTTP face's errors: `HTTPError` (an answer other than 200), the OpenAI error object
(`{"error": {"message", "type", "param", "code"}}`), the HTTP status for each gRPC status the
request path rejects with (and the gRPC name an HTTP error is counted under), and the OpenAI
name of a field that validation named by its proto path.

Knows HTTP statuses, the OpenAI error shape and pydantic's errors; nothing about routes,
streaming or runners.
"""

from __future__ import annotations

import re

import pydantic

from kvserve.frontend.requests import Rejected

STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
          "INTERNAL": 500, "UNAVAILABLE": 503}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


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
    for proto in ("prompt.chat.tools", "input.chat.tools"):  # a proto Tool is OpenAI's tool's function
        if field.startswith(proto):
            return "tools" + re.sub(r"^(\[\d+\])\.", r"\1.function.", field[len(proto):])
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


def _grpc_name(status: int) -> str:
    """The gRPC status name an HTTP error counts under in kvserve_request_errors_total."""
    for name, code in STATUS.items():
        if code == status:
            return name
    return {413: "RESOURCE_EXHAUSTED", 405: "NOT_FOUND"}.get(status, "INTERNAL" if status >= 500 else
                                                             "INVALID_ARGUMENT")
