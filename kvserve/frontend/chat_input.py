"""A request's chat (`kvserve.v1.Chat`) as a chat template takes it: messages as transformers
passes them (an assistant's `tool_calls` with their arguments as objects, a tool message's
`tool_call_id` and `name`) and the tools as OpenAI's tool objects.

Every problem is an InvalidArgument naming the field. Knows the proto and JSON; nothing about
tokenizers or HTTP. `InvalidArgument` is validation's error, defined here so both can raise it.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.model.tokenizer import CHAT_ROLES
from kvserve.v1 import generator_pb2 as pb


class InvalidArgument(ValueError):
    """A request field that is missing or out of range; str() names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def _object(text: str, field: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(field, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"{what} is a JSON object, got {type(value).__name__}")
    return value


def chat_chars(chat: pb.Chat) -> int:
    """The characters a chat carries (messages, calls and tools), for max_prompt_chars."""
    n = 0
    for m in chat.messages:
        n += len(m.role) + len(m.content) + len(m.name) + len(m.tool_call_id)
        n += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
    return n + sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)


def template_messages(chat: pb.Chat, field: str) -> list[dict[str, Any]]:
    """The messages as a chat template reads them."""
    out = []
    for i, m in enumerate(chat.messages):
        here = f"{field}.messages[{i}]"
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"{here}.role", f"unknown chat role {m.role!r} (expected one of "
                                                  f"{', '.join(CHAT_ROLES)})")
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            if m.role != "tool":
                raise InvalidArgument(f"{here}.tool_call_id", "only a tool message answers a call")
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidArgument(f"{here}.tool_calls", "only an assistant message makes calls")
            calls = []
            for j, c in enumerate(m.tool_calls):
                if not c.name:
                    raise InvalidArgument(f"{here}.tool_calls[{j}].name", "empty")
                args = _object(c.arguments or "{}", f"{here}.tool_calls[{j}].arguments", "the arguments")
                # templates write the arguments as an object (`arguments | tojson`), as transformers passes them
                calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def template_tools(chat: pb.Chat, field: str) -> list[dict[str, Any]] | None:
    """The tools as OpenAI's tool objects (None: the chat has none)."""
    if not chat.tools:
        return None
    tools, seen = [], set()
    for i, t in enumerate(chat.tools):
        if not t.name:
            raise InvalidArgument(f"{field}.tools[{i}].name", "empty")
        if t.name in seen:
            raise InvalidArgument(f"{field}.tools[{i}].name", f"{t.name!r} is named twice")
        seen.add(t.name)
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = (_object(t.parameters, f"{field}.tools[{i}].parameters", "a JSON schema")
                                  if t.parameters else {"type": "object", "properties": {}})
        tools.append({"type": "function", "function": function})
    return tools
