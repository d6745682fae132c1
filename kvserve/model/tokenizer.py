"""The tokenizer as the frontend uses it: encode text, render chats, decode ids.

Torch-free and transformers-free: a `tokenizers.Tokenizer` (tokenizer.json) plus the chat
template (`kvserve.model.chat_template`), giving the ids and text that the transformers
tokenizer of the same model gives (`encode(text, add_special_tokens=False)`,
`decode(ids, skip_special_tokens=True)`, `apply_chat_template`).

`load_frontend_tokenizer(spec, model)` loads the model's tokenizer: from a HF directory
(tokenizer.json, tokenizer_config.json, generation_config.json / config.json) or from a
GGUF file (the header for EOS ids, chat template, vocabulary size and context length; the
tokenizer.json that `kvserve.model.tokenizer_cache` builds once in a child process). For
``spec == "bytes"`` it returns `ByteTokenizer`, a byte-level tokenizer built in code (ids
0..255 are bytes, 256 is EOS) so that frontend logic is tested in seconds on the same code
path. Knows nothing about gRPC, runners or weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvserve.model import tokenizer_cache
from kvserve.model.chat_template import ChatTemplate, ChatTemplateError
from kvserve.model.files import (
    ModelFileError,
    gguf_context,
    gguf_eos_ids,
    gguf_fields,
    hf_context,
    model_name,
    resolve_model,
)

CHAT_ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
# transformers' clean_up_tokenization_spaces, which it applies to non-BPE tokenizers only.
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class FrontendTokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_ids: list[int]
    max_context_len: int
    has_chat_template: bool
    renders_tools: bool
    backend: Tokenizer  # what the incremental detokenizer streams through
    stable_replacement: bool  # a decoded U+FFFD followed by more text never changes (no ByteFallback)
    silent_ids: frozenset[int]  # special ids, which decode() drops
    known_ids: int  # ids at or past this have no token; decode() drops them too

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ModelTokenizer:
    """A `tokenizers.Tokenizer` with the model's EOS ids, limits and chat template."""

    __slots__ = ("backend", "name", "vocab_size", "eos_token_ids", "max_context_len", "chat",
                 "cleanup", "stable_replacement", "silent_ids", "known_ids")

    def __init__(self, backend: Tokenizer, *, name: str, vocab_size: int, eos_token_ids: Sequence[int],
                 max_context_len: int, chat: ChatTemplate | None, cleanup: bool = False) -> None:
        self.backend = backend
        self.name = name
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_context_len = max_context_len
        self.chat = chat
        self.cleanup = cleanup and type(backend.model).__name__ != "BPE"
        decoder = backend.decoder
        self.stable_replacement = decoder is None or b"ByteFallback" not in decoder.__getstate__()
        self.silent_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.known_ids = backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat is not None

    @property
    def renders_tools(self) -> bool:
        """The chat template shows the model the tools of a chat."""
        return self.chat is not None and self.chat.renders_tools

    @property
    def chat_template(self) -> str | None:
        return self.chat.source if self.chat is not None else None

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it throughout), so a
        # long text tokenized in a worker thread does not stall the frontend's event loop
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the chat (and its tools) rendered by the model's template;
        ChatTemplateError if it refuses."""
        if self.chat is None:
            raise ChatTemplateError("chat: the model has no chat template")
        return self.encode(self.chat.render(messages, add_generation_prompt, tools))

    def decode(self, ids: list[int]) -> str:
        text = self.backend.decode(ids, skip_special_tokens=True)
        if self.cleanup:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text


def _byte_chars() -> list[str]:
    """The printable character GPT-2's byte-level alphabet uses for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class ByteTokenizer(ModelTokenizer):
    """UTF-8 bytes as tokens (0..255) plus EOS (256); a plain-text chat format.

    A real byte-level `tokenizers.Tokenizer` (GPT-2's byte alphabet, no merges), so that it
    streams through the same detokenizer as a model's tokenizer. Text is always bytes:
    "<|eos|>" in a prompt encodes as its 7 bytes, never as id 256.
    """

    __slots__ = ()

    def __init__(self, max_context_len: int = 4096) -> None:
        vocab = {ch: b for b, ch in enumerate(_byte_chars())}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken("<|eos|>", special=True, normalized=False)])
        backend.encode_special_tokens = True
        super().__init__(backend, name="bytes", vocab_size=257, eos_token_ids=[256],
                         max_context_len=max_context_len,
                         chat=ChatTemplate(BYTE_CHAT_TEMPLATE, {"eos_token": "<|eos|>"}))


def _json_file(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelFileError(f"model file {path}: no such file")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"model file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"model file {path}: expected a JSON object")
    return data


def _backend(directory: Path) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelFileError(f"model {directory}: no tokenizer.json (a fast tokenizer is required)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise ModelFileError(f"model file {path}: not a readable tokenizer ({exc})") from None


def _special_tokens(directory: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them (tokenizer_config.json, then
    special_tokens_map.json)."""
    out: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = _json_file(directory / name, required=False)
        for key in SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and key not in out:
                out[key] = value
    return out


def _dir_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The default template: chat_template.jinja, additional_chat_templates/default.jinja,
    then tokenizer_config.json's chat_template (a string, or named templates), then
    chat_template.json; the order transformers reads them in."""
    for file in (directory / "chat_template.jinja", directory / "additional_chat_templates" / "default.jinja"):
        if file.is_file():
            return file.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(value, str):
        return value
    legacy = _json_file(directory / "chat_template.json", required=False).get("chat_template")
    return legacy if isinstance(legacy, str) else None


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _compile(template: str | None, specials: dict[str, str], where: Path) -> ChatTemplate | None:
    if not template:
        return None
    try:
        return ChatTemplate(template, specials)
    except ChatTemplateError as exc:
        raise ModelFileError(f"model {where}: {exc}") from None


def _from_hf_dir(path: Path) -> ModelTokenizer:
    backend = _backend(path)
    config = _json_file(path / "tokenizer_config.json", required=False)
    specials = _special_tokens(path)
    model_cfg = _json_file(path / "config.json", required=True)
    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        for i in _ids(_json_file(path / name, required=False).get("eos_token_id")):
            if i not in eos:
                eos.append(i)
    eos_tok = backend.token_to_id(specials["eos_token"]) if "eos_token" in specials else None
    if eos_tok is not None and eos_tok not in eos:
        eos.append(eos_tok)
    try:
        vocab_size = int(model_cfg.get("vocab_size") or backend.get_vocab_size())
        context = hf_context(model_cfg)
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"model file {path / 'config.json'}: bad vocab_size or max_position_embeddings ({exc})") from None
    return ModelTokenizer(
        backend, name=model_name(path), vocab_size=vocab_size, eos_token_ids=eos, max_context_len=context,
        chat=_compile(_dir_chat_template(path, config), specials, path),
        cleanup=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def _from_gguf(path: Path) -> ModelTokenizer:
    fields = gguf_fields(path)
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"model {path}: GGUF has no general.architecture")
    directory = tokenizer_cache.ensure_cached(path)
    backend = _backend(directory)
    config = _json_file(directory / "tokenizer_config.json", required=False)
    specials = _special_tokens(directory)
    eos = gguf_eos_ids(fields)
    if not eos and "eos_token" in specials and backend.token_to_id(specials["eos_token"]) is not None:
        eos = [backend.token_to_id(specials["eos_token"])]
    vocab_size = fields.get(f"{arch}.vocab_size") or fields.get("tokenizer.ggml.tokens#len")
    if not vocab_size:
        raise ModelFileError(f"model {path}: GGUF metadata gives no vocabulary size")
    template = fields.get("tokenizer.chat_template")
    if not isinstance(template, str):
        template = _dir_chat_template(directory, config)
    return ModelTokenizer(
        backend, name=model_name(path), vocab_size=int(vocab_size), eos_token_ids=eos,
        max_context_len=gguf_context(fields, arch),
        chat=_compile(template, specials, path),
        cleanup=bool(config.get("clean_up_tokenization_spaces", False)),
    )


def load_model_tokenizer(spec: str | None) -> ModelTokenizer:
    """The tokenizer of the model `spec` names (None or "": the embedded default model)."""
    path = resolve_model(spec)
    return _from_hf_dir(path) if path.is_dir() else _from_gguf(path)


def load_frontend_tokenizer(spec: str, model: str) -> FrontendTokenizer:
    """Return the tokenizer named by `spec` ("bytes") or the one of `model` (spec "")."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec:
        raise ValueError(f"--tokenizer: unknown tokenizer {spec!r} (use '' for the model's, or 'bytes')")
    return load_model_tokenizer(model or None)
