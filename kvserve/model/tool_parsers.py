"""Tool calls as model families write them: finding them in a reply as it streams, and the
grammar that makes a reply be calls.

A family (`FAMILIES`) is one way of writing calls:
- ``hermes`` (Hermes, Qwen 2.5 / 3 and most templates since): ``<tool_call>`` + a JSON object
  ``{"name": ..., "arguments": {...}}`` + ``</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1-3.3): the reply is the JSON object ``{"name": ..., "parameters":
  {...}}`` (after ``<|python_tag|>`` where the model writes it), calls separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects, or (the
  newer templates) ``[TOOL_CALLS]name{...}`` per call, with or without ``[ARGS]`` between.
`family_of(template)` picks one from a chat template's text.

`ToolStream` reads a reply piece by piece and gives back content (text that is not a call)
and `Call`s the moment each is complete; a whole reply is read the same way, so a streamed
reply and a whole one always agree. Text that looks like a call and does not parse is content.
`grammar(family, tools, many)` is the Lark grammar (llguidance's, with `%json` schemas) of a
reply made only of calls to `tools`, each call's arguments valid against its schema.

Knows JSON and the families' formats; nothing about HTTP, tokenizers' internals or runners.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from kvserve.config.frontend import FAMILY_NAMES


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text of an object, written as OpenAI writes it


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # the JSON schema of its arguments


def _call(obj: Any, keys: tuple[str, ...]) -> Call | None:
    """`obj` as a call when it is {"name": str, <one of keys>: object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {} if len(obj) == 1 else None)
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `pos` and the offset after it; None where it does not parse
    (yet: the text may still be arriving)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):  # a reply nested past Python's limit is not a call
        return None


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _rebased(node: Any, base: str) -> Any:
    """`node` (part of a schema moved under `base`) with its `$ref`s into itself moved along:
    ``#`` and ``#/properties/...`` gain the base; ``#/$defs/...`` stay (the defs move to the root)."""
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebased(v, base) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and \
            not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = base + ref[1:]
    return out


Item = str | Call
"""What a reply is read into: content text, or a call."""


class Family:
    """One way of writing calls. `find` says where the calls begin in the content read so
    far; `split` reads the calls' text into items."""

    name = ""
    marker = ""  # the text that opens the calls
    args_keys: tuple[str, ...] = ("arguments",)

    def find(self, text: str, at_start: bool) -> tuple[int, int]:
        """(index where calls begin, -1 if not in `text`; characters to hold back, -1 when no
        call can begin in this reply any more). `at_start`: no content was emitted yet."""
        i = text.find(self.marker)
        return (i, 0) if i >= 0 else (-1, _held_prefix(text, self.marker))

    def split(self, text: str, final: bool) -> tuple[list[Item], str]:
        """The complete items at the head of `text` (which begins with the calls) and the
        text still open; `final`: the reply has ended, nothing stays open. For a family whose
        every call opens with its marker: prose up to a marker, then the block there."""
        items: list[Item] = []
        while text:
            head = text.lstrip()
            if not head.startswith(self.marker):
                text, go_on = self.split_prose(text, final, items)
                if not go_on:
                    return items, text
                continue
            if len(head) < len(text):
                items.append(text[:len(text) - len(head)])  # whitespace (dropped between calls)
            text = head
            read = self.block(text, final)
            if read is None:
                return items, text
            block, end = read
            items.extend(block)
            text = text[end:]
        return items, ""

    def block(self, text: str, final: bool) -> tuple[list[Item], int] | None:
        """The calls (or, not parsing, the content) `text`, which begins with the marker, opens
        with, and where they end; None while they may still be arriving."""
        raise NotImplementedError

    def call_id(self) -> str:
        """A new call's id, as OpenAI writes them."""
        return "call_" + secrets.token_hex(12)

    def body_schema(self, tool: Tool) -> dict[str, Any]:
        """One call's JSON schema: the tool's name and its arguments' schema, whose `$defs` (and
        `definitions`) move to the root so that its `#/...` references still resolve."""
        key = self.args_keys[0]
        params = dict(tool.parameters)
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        params = _rebased(params, f"#/properties/{key}")
        return {"type": "object", "properties": {"name": {"const": tool.name}, key: params},
                "required": ["name", key], "additionalProperties": False, **_rebased(defs, f"#/properties/{key}")}

    def split_prose(self, text: str, final: bool, items: list[Item]) -> tuple[str, bool]:
        """Content up to the next marker in `text` (which does not begin with one, less
        whitespace) into `items`; (the text left, whether to go on reading)."""
        head = text.lstrip()
        if not final and self.marker.startswith(head):  # whitespace, or a marker's start: wait
            return text, False
        nxt = text.find(self.marker)
        if nxt < 0:
            keep = 0 if final else _held_prefix(text, self.marker)
            items.append(text[:len(text) - keep])
            return text[len(text) - keep:], False
        items.append(text[:nxt])
        return text[nxt:], True

    def rules(self, many: bool, auto: bool, marker_token: int | None) -> str:
        """The grammar's rules but `body` (one call's JSON): a reply of calls only, or (`auto`)
        a reply of text without calls or text then calls."""
        raise NotImplementedError


class Hermes(Family):
    name = "hermes"
    marker = "<tool_call>"
    end = "</tool_call>"

    def block(self, text: str, final: bool) -> tuple[list[Item], int] | None:
        """The JSON is read first, so a `</tool_call>` inside one of its strings does not cut it;
        a call whose JSON is whole is a call with or without its closing tag."""
        pos = len(self.marker)
        body = text[pos:].lstrip()
        pos = len(text) - len(body)
        found = _json_at(text, pos) if body.startswith("{") else None
        call = _call(found[0], self.args_keys) if found else None
        if call is not None:
            end = found[1]
            rest = text[end:].lstrip()
            if rest.startswith(self.end):
                return [call], len(text) - len(rest) + len(self.end)
            if not final and self.end.startswith(rest):  # the closing tag may still come
                return None
            return [call], end
        if not final:  # unparsed so far: more of the JSON may come
            return None
        close = text.find(self.end)
        end = len(text) if close < 0 else close + len(self.end)
        return [text[:end]], end  # not a call: content

    def rules(self, many: bool, auto: bool, marker_token: int | None) -> str:
        calls = '"\\n" body "\\n</tool_call>"' + (' ("\\n<tool_call>\\n" body "\\n</tool_call>")*' if many else "")
        if auto:  # the text's stop string is the first call's marker
            return ('start: PROSE | prose calls\nPROSE: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/\n'
                    f'prose[stop="<tool_call>"]: /(?s:.*)/\ncalls: {calls}')
        return f'start: "<tool_call>" calls\ncalls: {calls}'


class Llama3Json(Family):
    name = "llama3_json"
    marker = "<|python_tag|>"
    args_keys = ("parameters", "arguments")

    WS = " \t\n\r"  # the whitespace the auto grammar lets come before a call

    def find(self, text: str, at_start: bool) -> tuple[int, int]:
        if not at_start:
            return -1, -1
        head = text.lstrip(self.WS)
        lead = len(text) - len(head)
        if head.startswith(("{", self.marker)):
            return lead, 0
        if head == "" or self.marker.startswith(head):
            return -1, len(text)
        return -1, -1

    def split(self, text: str, final: bool) -> tuple[list[Item], str]:
        items: list[Item] = []
        text = text.removeprefix(self.marker) if text.startswith(self.marker) else text
        pos = 0
        while True:
            start = pos
            while pos < len(text) and (text[pos] in self.WS or text[pos] == ";"):
                pos += 1
            if pos == len(text):  # only separators so far: kept until something follows
                return items, "" if final else text[start:]
            found = _json_at(text, pos) if text[pos] == "{" else None
            if found is None:
                if not final and text[pos] == "{":
                    return items, text[start:]
                items.append(text[start:])  # not a call: the rest of the reply is content
                return items, ""
            call = _call(found[0], self.args_keys)
            items.append(call if call is not None else text[pos:found[1]])
            pos = found[1]

    def rules(self, many: bool, auto: bool, marker_token: int | None) -> str:
        calls = "body" + (' ("; " body)*' if many else "")
        if auto:  # text that does not open with "{", or the calls
            return f"start: PROSE | calls\nPROSE: /(?s:.*)/ & ~/[ \\t\\n\\r]*\\{{(?s:.*)/\ncalls: {calls}"
        return f"start: calls\ncalls: {calls}"


class Mistral(Family):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+(?:\[ARGS\])?")

    def call_id(self) -> str:
        """Mistral's templates take only ids of 9 letters and digits."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def block(self, text: str, final: bool) -> tuple[list[Item], int] | None:
        pos = len(self.marker)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        named = self._NAME.match(text, pos)
        if named and not text.startswith("[", pos):
            name_end = named.end()
            found = _json_at(text, name_end) if text.startswith("{", name_end) else None
            calls = [_call({"name": named.group().removesuffix("[ARGS]"), "arguments": found[0]},
                           self.args_keys)] if found else None
        else:
            found = _json_at(text, pos) if text.startswith("[", pos) else None
            calls = [_call(o, self.args_keys) for o in found[0]] if found and isinstance(found[0], list) else None
        if found is None and not final:
            return None
        end = found[1] if found else len(text)
        if calls and all(c is not None for c in calls):
            return [c for c in calls if c is not None], end
        return [text[:end]], end

    def rules(self, many: bool, auto: bool, marker_token: int | None) -> str:
        calls = '"[" body' + (' (", " body)*' if many else "") + ' "]"'
        if marker_token is not None:  # a special token: text cannot hold it, no stop string needed
            head = "start: PROSE | PROSE? mark calls\nPROSE: /(?s:.*)/\n" if auto else "start: mark calls\n"
            return f"{head}mark: <[{marker_token}]>\ncalls: {calls}"
        if auto:
            return ('start: PROSE | prose calls\nPROSE: /(?s:.*)/ & ~/(?s:.*\\[TOOL_CALLS\\].*)/\n'
                    f'prose[stop="[TOOL_CALLS]"]: /(?s:.*)/\ncalls: {calls}')
        return f'start: "[TOOL_CALLS]" calls\ncalls: {calls}'


FAMILIES: dict[str, Family] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}
assert tuple(FAMILIES) == FAMILY_NAMES


def family_of(template: str | None) -> Family | None:
    """The family a chat template writes calls in (None: it writes none that kvserve knows)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return FAMILIES["hermes"]
    if "[TOOL_CALLS]" in template:
        return FAMILIES["mistral"]
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return FAMILIES["llama3_json"]
    return None


def grammar(family: Family, tools: list[Tool], many: bool, auto: bool = False,
            marker_token: int | None = None) -> str:
    """The Lark grammar of a reply that is one call (`many`: one or more) to one of `tools`, or
    (`auto`) text without calls or text then such calls; `marker_token`: the id of the family's
    marker where it is a special token."""
    from kvserve.model.grammars import JSON_STYLE

    # a rule per tool: each call's schema is a root of its own, where its $defs resolve
    bodies = "".join(f"\nbody_{i}: %json " + json.dumps({"x-guidance": JSON_STYLE} | family.body_schema(t))
                     for i, t in enumerate(tools))
    alternatives = " | ".join(f"body_{i}" for i in range(len(tools)))
    return f"{family.rules(many, auto, marker_token)}\nbody: {alternatives}{bodies}"


class ToolStream:
    """One reply read piece by piece into content and calls (`push`, then `push(final=True)`).
    Leading whitespace is held until something else comes, and dropped before the calls."""

    def __init__(self, family: Family) -> None:
        self.family = family
        self.calls: list[Call] = []
        self._pending = ""
        self._in_calls = False
        self._no_calls = False  # the family allows calls only at the start, and content came first
        self._said = False  # content was emitted
        self._gap = ""  # whitespace after a call: content if content follows, dropped if a call does

    def push(self, text: str, final: bool = False) -> list[Item]:
        """The items `text` completes (content as str, calls as Call)."""
        self._pending += text
        out: list[Item] = []
        if not self._in_calls:
            if self._no_calls:
                return self._say(out, len(self._pending), True)
            start, hold = self.family.find(self._pending, not self._said)
            if start < 0:
                if hold < 0:
                    self._no_calls = True
                    hold = 0
                return self._say(out, len(self._pending) - (0 if final else hold), final)
            before = self._pending[:start]
            self._pending = self._pending[start:]
            if self._said or before.strip():
                out.append(before)
                self._said = True
            self._in_calls = True
        items, self._pending = self.family.split(self._pending, final)
        for item in items:
            if isinstance(item, Call):
                self.calls.append(item)
                out.append(item)
                self._gap = ""
            elif not item.strip():  # whitespace between the calls or after the last is not content
                self._gap += item
            else:
                out.append(self._gap + item)
                self._gap = ""
                self._said = True
        return out

    def _say(self, out: list[Item], upto: int, final: bool) -> list[Item]:
        text = self._pending[:upto]
        if not self._said and not text.strip() and not final:
            return out  # only whitespace so far: held
        if text:
            out.append(text)
            self._said = True
            self._pending = self._pending[upto:]
        return out
