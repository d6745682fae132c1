"""The tokenizer as the frontend uses it: encode text, render chats, decode ids.

`load_frontend_tokenizer(spec, model)` wraps the model's tokenizer
(`kvserve.model.weights.load_tokenizer`) or, for ``spec == "bytes"``, a byte-level
tokenizer that needs no model (ids 0..255 are bytes, 256 is EOS) so frontend logic can be
tested in seconds. Knows nothing about gRPC or runners.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

CHAT_ROLES = ("system", "user", "assistant", "tool")


class FrontendTokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_ids: list[int]
    max_context_len: int
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(slots=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens (0..255) plus EOS (256); a plain-text chat format."""

    name: str = "bytes"
    vocab_size: int = 257
    eos_token_ids: tuple[int, ...] = (256,)
    max_context_len: int = 4096
    has_chat_template: bool = True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_chat(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> list[int]:
        text = "".join(f"<{role}>{content}\n" for role, content in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(slots=True)
class ModelTokenizer:
    """A Hugging Face tokenizer from `weights.load_tokenizer` (a `TokenizerBundle`)."""

    tokenizer: Any
    name: str
    vocab_size: int
    eos_token_ids: list[int]
    max_context_len: int
    chat_template: str | None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> list[int]:
        if not self.chat_template:
            raise ValueError("chat: the model has no chat template")
        text = self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_frontend_tokenizer(spec: str, model: str) -> FrontendTokenizer:
    """Return the tokenizer named by `spec` ("bytes") or the one of `model` (spec "")."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec:
        raise ValueError(f"--tokenizer: unknown tokenizer {spec!r} (use '' for the model's, or 'bytes')")
    from kvserve.model.weights import load_tokenizer

    bundle = load_tokenizer(model or None)
    return ModelTokenizer(
        tokenizer=bundle.tokenizer,
        name=bundle.name,
        vocab_size=int(bundle.vocab_size),
        eos_token_ids=list(bundle.eos_token_ids),
        max_context_len=int(bundle.max_context_len),
        chat_template=bundle.chat_template,
    )
