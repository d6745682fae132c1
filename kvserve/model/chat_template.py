"""A model's chat template (Jinja), rendered as Hugging Face transformers renders it.

transformers' `apply_chat_template` compiles the template in a sandboxed, immutable Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
`tojson` filter that does not HTML-escape, and the globals `raise_exception` and
`strftime_now`; it renders with ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``,
...). `ChatTemplate` does the same with jinja2 alone, so that the same chat gives the same
text (and so the same token ids) without importing transformers. It knows nothing about
tokenizers beyond the special-token strings it is given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that refuses a chat (`raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    for rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template and the special-token strings it may refer to."""

    __slots__ = ("source", "special_tokens", "renders_tools", "_template")

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        """`special_tokens`: template variable -> token text, e.g. {"bos_token": "<s>"}."""
        env = _environment()
        try:
            ast = env.parse(source)  # parsed once: compiled, and read for the variables it uses
            self._template = env.from_string(ast)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat_template: does not compile ({exc})") from None
        # whether the template reads `tools` (shows the model the tools of a chat)
        self.renders_tools = "tools" in meta.find_undeclared_variables(ast)
        self.source = source
        self.special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[tuple[str, str] | Mapping[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of `messages` ((role, content) pairs, or messages as transformers
        takes them: with tool_calls, tool_call_id, name) and `tools` (OpenAI's tool objects)."""
        chat = [dict(m) if isinstance(m, Mapping) else {"role": m[0], "content": m[1]} for m in messages]
        try:
            return self._template.render(
                messages=chat, tools=tools or None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat: the model's chat template refused it: {exc}") from None
