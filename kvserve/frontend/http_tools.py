"""Tool calling on the HTTP face: a chat's `tools` and `tool_choice` as the prompt's tools and,
where a reply must be calls (``required``, a named function, or ``auto`` with a strict tool), a
grammar constraint; the replies read back into `tool_calls` by the family's `ToolStream`.

`ToolPlan.of(body, ...)` checks the fields (a 400 naming the one at fault) and says what the
request asks; `ToolReplies` turns each choice's steps into content and call deltas, streamed or
whole. Knows the OpenAI tool shapes and `kvserve.model.tool_parsers`; nothing about runners.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvserve.frontend.http_errors import HTTPError, _unsupported
from kvserve.frontend.openai_models import ChatCompletionRequest
from kvserve.frontend.requests import Step
from kvserve.model.tool_parsers import FAMILIES, Call, Family, Tool, ToolStream, family_of, grammar
from kvserve.v1 import generator_pb2 as pb


def _bad(param: str, problem: str) -> HTTPError:
    return HTTPError(400, f"{param}: {problem}", param, "invalid_value")


@dataclass(slots=True)
class ToolPlan:
    family: Family
    named: str | None  # tool_choice named this function
    one: bool  # parallel_tool_calls false: at most one call
    marker_id: int | None  # the family's marker as a special token (decoded to nothing)
    constraint: pb.Constraint | None

    @staticmethod
    def of(body: ChatCompletionRequest, family: Family | None, marker_id: int | None,
           parser_setting: str) -> ToolPlan | None:
        """What `body` asks of tools (None: replies are text); HTTPError naming a bad field."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none", "auto"):
                raise _bad("tool_choice", "needs tools")
            return None
        if parser_setting == "none":
            raise _unsupported("tools", "tool calling (this server runs with --tool-call-parser none)")
        if choice == "none":
            return None  # the template shows the tools; the reply is text
        if family is None:
            raise _unsupported("tools", "tool calling with this model: its chat template writes calls in no "
                                        "format kvserve reads (name one with --tool-call-parser)")
        tools = [Tool(t.function.name, t.function.parameters or {"type": "object", "properties": {}})
                 for t in body.tools]
        named = None if isinstance(choice, str) or choice is None else choice.function.name
        if named is not None and named not in {t.name for t in tools}:
            raise _bad("tool_choice.function.name", f"{named!r} is not one of the tools")
        one = not body.parallel_tool_calls
        constraint = None
        if named is not None:
            constraint = grammar(family, [t for t in tools if t.name == named], False, marker_token=marker_id)
        elif choice == "required":
            constraint = grammar(family, tools, not one, marker_token=marker_id)
        elif any(t.function.strict for t in body.tools):  # auto, with arguments that must follow their schemas
            constraint = grammar(family, tools, not one, auto=True, marker_token=marker_id)
        return ToolPlan(family, named, one, marker_id,
                        None if constraint is None else pb.Constraint(grammar=constraint))


def tool_family(setting: str, tok: object) -> tuple[Family | None, int | None]:
    """The family replies are read with (`setting`: --tool-call-parser; '' = the chat template's)
    and its marker's id where the tokenizer has the marker as one special token."""
    family = FAMILIES.get(setting) if setting else family_of(getattr(tok, "chat_template", None))
    if family is None:
        return None, None
    backend = getattr(tok, "backend", None)
    marker_id = backend.token_to_id(family.marker) if backend is not None else None
    special = marker_id is not None and marker_id in getattr(tok, "silent_ids", ())
    return family, marker_id if special else None


def chat_tools(body: ChatCompletionRequest) -> list[pb.Tool]:
    """The request's tools as the proto's (the template renders them)."""
    return [pb.Tool(name=t.function.name, description=t.function.description or "",
                    parameters="" if t.function.parameters is None else json.dumps(t.function.parameters))
            for t in body.tools or []]


@dataclass(slots=True)
class _Reply:
    stream: ToolStream
    ids: list[str] = field(default_factory=list)


class ToolReplies:
    """Each choice's reply read for calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._replies: dict[int, _Reply] = {}

    def _text(self, step: Step) -> str:
        """The step's text as the family reads it: a special marker token, which decodes to
        nothing, put back as its text. A runner output is one token, so any text the step
        carries was held back from earlier tokens and comes before the marker."""
        marker = self.plan.marker_id is not None and self.plan.marker_id in step.token_ids
        return step.text + (self.plan.family.marker if marker else "")

    def _read(self, index: int, text: str, final: bool) -> tuple[str, list[tuple[int, str, Call]]]:
        reply = self._replies.setdefault(index, _Reply(ToolStream(self.plan.family)))
        content, calls = "", []
        for item in reply.stream.push(text, final):
            if isinstance(item, str):
                content += item
            elif not (self.plan.one and reply.ids):
                reply.ids.append(self.plan.family.call_id())
                calls.append((len(reply.ids) - 1, reply.ids[-1], item))
        return content, calls

    def finish_reason(self, index: int, reason: str) -> str:
        reply = self._replies.get(index)
        called = reply is not None and bool(reply.ids)
        return "tool_calls" if called and reason == "stop" and self.plan.named is None else reason

    def step(self, index: int, step: Step) -> tuple[str, list[dict]]:
        """The content and the tool_calls deltas (a head with id and name, then the arguments)
        that `step` completes."""
        content, calls = self._read(index, self._text(step), bool(step.finish_reason))
        deltas = []
        for k, call_id, call in calls:
            deltas.append({"index": k, "id": call_id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": k, "function": {"arguments": call.arguments}})
        return content, deltas

    def message(self, index: int, steps: list[Step]) -> dict:
        """The whole reply as a chat message, with its tool_calls."""
        content, calls = self._read(index, "".join(self._text(s) for s in steps), True)
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for _, call_id, c in calls]}
