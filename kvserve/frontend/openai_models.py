"""Pydantic models of the OpenAI-compatible request bodies the HTTP face accepts.

Types are checked strictly (a string is not a number, 1 is not true), and every error
names its field. Fields that kvserve does not use are kept in `model_extra` rather than
refused: routers re-serialize requests and add vLLM's and SGLang's fields, and the HTTP face
counts them as ignored. Fields that would change the output in a way kvserve cannot honour
(echo on a chat, best_of, suffix, ...) are declared here so that the face can refuse them by name.

Knows pydantic only; nothing about the proto, the runners or HTTP routing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class _Sampling(_Body):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, SGLang's three
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """POST /v1/completions (and /v1/completions/render)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class MessageToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[MessageToolCall] | None = None  # an assistant message: the calls it made


class FunctionSpec(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema where a call is constrained


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (and /v1/chat/completions/render)."""

    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: prepend the last message to the reply (refused)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    """POST /tokenize, vLLM's shape: a prompt or a chat."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    """POST /detokenize, vLLM's shape."""

    model: str | None = None
    tokens: list[TokenId]
