"""The OpenAI request bodies (pydantic, `openai_models`) as kvserve's proto messages: the
prompt or prompts of a completion, a chat's messages, the sampling fields. Range checks are
not here: they come later, in validation, the same for gRPC and HTTP.

Knows the OpenAI body models and the proto; nothing about routes, responses or runners.
"""

from __future__ import annotations

from kvserve.frontend.http_errors import HTTPError, _unsupported
from kvserve.frontend.openai_models import CompletionRequest, _Sampling
from kvserve.v1 import generator_pb2 as pb


def _sampling(body: _Sampling, max_tokens: int | None, logprobs: int) -> pb.SamplingParams:
    """The OpenAI/vLLM sampling fields as kvserve's (range checks come later, in validation)."""
    s = pb.SamplingParams(stop=body.stops(), stop_token_ids=body.stop_token_ids or [],
                          ignore_eos=body.ignore_eos, logprobs=logprobs)
    s.temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if body.top_k is not None:
        s.top_k = max(body.top_k, 0)  # vLLM spells "off" -1, kvserve 0
    if body.seed is not None:
        s.seed = body.seed % 2**64
    if max_tokens is not None:
        s.max_new_tokens = max_tokens
    for key, bias in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= 2**32:
            raise HTTPError(400, f"logit_bias: key {key!r} is not a token id", "logit_bias", "invalid_value")
        s.logit_bias[int(key)] = bias
    return s


def _chat(messages: list, add_generation_prompt: bool) -> pb.Chat:
    chat = pb.Chat(add_generation_prompt=add_generation_prompt)
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, dict):  # a part of another type (image, audio, ...)
                    raise _unsupported(f"messages[{i}].content[{j}]", f"a content part of type "
                                                                      f"{part.get('type')!r}")
                texts.append(part.text)
            content = "\n".join(texts)
        msg = chat.messages.add(role="system" if m.role == "developer" else m.role, content=content or "",
                                name=m.name or "", tool_call_id=m.tool_call_id or "")
        for c in m.tool_calls or []:
            msg.tool_calls.add(id=c.id, name=c.function.name, arguments=c.function.arguments)
    return chat


def _prompts(body: CompletionRequest) -> list[pb.GenerateRequest]:
    p = body.prompt
    if isinstance(p, str):
        return [pb.GenerateRequest(text=p)]
    if not p or isinstance(p[0], int):
        return [pb.GenerateRequest(token_ids=pb.TokenIds(ids=p))]  # type: ignore[arg-type]
    return [pb.GenerateRequest(text=x) if isinstance(x, str) else pb.GenerateRequest(token_ids=pb.TokenIds(ids=x))
            for x in p]
