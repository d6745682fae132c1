"""Request validation: every bad field gives InvalidArgument naming it; defaults apply."""

from __future__ import annotations

import pytest

from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.validation import InvalidArgument, prepare, prompt_ids
from kvserve.model.tokenizer import ByteTokenizer, ChatTemplateError
from kvserve.v1 import generator_pb2 as pb

TOK = ByteTokenizer()
CFG = FrontendConfig(tokenizer="bytes", max_new_tokens_cap=100, max_stop_strings=2, max_stop_len=8,
                     max_stop_token_ids=3, max_chat_messages=3, max_prompt_chars=20)


def _req(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))


BAD = [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(text=""), "prompt.text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt.token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 999])), "prompt.token_ids[1]"),
    (pb.GenerateRequest(chat=pb.Chat()), "prompt.chat.messages"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])),
     "prompt.chat.messages[0].role"),
    (_req(max_new_tokens=0), "sampling.max_new_tokens"),
    (_req(max_new_tokens=101), "sampling.max_new_tokens"),
    (_req(temperature=-0.1), "sampling.temperature"),
    (_req(temperature=float("nan")), "sampling.temperature"),
    (_req(top_p=0.0), "sampling.top_p"),
    (_req(top_p=1.5), "sampling.top_p"),
    (_req(top_k=-1), "sampling.top_k"),
    (_req(min_p=1.5), "sampling.min_p"),
    (_req(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (_req(stop=["a", "b", "c"]), "sampling.stop"),
    (_req(stop=["x" * 9]), "sampling.stop[0]"),
    (_req(stop_token_ids=[5000]), "sampling.stop_token_ids[0]"),
    (_req(logprobs=-1), "sampling.logprobs"),
    (pb.GenerateRequest(text="é" * 16), "prompt"),  # 16 characters, 32 tokens > 31
    (_req(stop_token_ids=[1, 2, 3, 4]), "sampling.stop_token_ids"),
    (pb.GenerateRequest(text="x" * 21), "prompt.text"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")] * 4)),
     "prompt.chat.messages"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x" * 8)] * 2)),
     "prompt.chat"),  # 2 * (4 + 8) characters
]


@pytest.mark.parametrize(("request_", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_input_names_the_field(request_: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        prepare(request_, TOK, CFG, context_len=32)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_defaults_are_greedy_and_capped() -> None:
    prep = prepare(pb.GenerateRequest(text="héllo"), TOK, CFG, context_len=32)
    assert prep.prompt_ids == list("héllo".encode())
    p = prep.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
    assert p.max_new_tokens == 100  # default 128 capped at max_new_tokens_cap
    assert p.seed is None


def test_explicit_values_pass_through() -> None:
    prep = prepare(_req(temperature=0.7, top_p=0.9, top_k=5, seed=7, max_new_tokens=3,
                        stop_token_ids=[10], stop=["z"], ignore_eos=True, logprobs=2),
                   TOK, CFG, context_len=32)
    p = prep.params
    assert p.top_k == 5 and p.seed == 7 and p.max_new_tokens == 3 and p.ignore_eos
    assert p.stop_token_ids == [10] and p.logprobs == 2 and prep.stops == ("z",)
    assert abs(p.temperature - 0.7) < 1e-6


def test_chat_is_rendered_with_generation_prompt() -> None:
    req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]))
    prep = prepare(req, TOK, CFG, context_len=64)
    assert bytes(prep.prompt_ids).decode() == "<user>hi\n<assistant>"


def test_max_prompt_tokens_limits_below_context() -> None:
    cfg = FrontendConfig(tokenizer="bytes", max_prompt_tokens=3)
    with pytest.raises(InvalidArgument, match="^prompt: 4 tokens"):
        prepare(pb.GenerateRequest(text="abcd"), TOK, cfg, context_len=100)


class _RefusingTemplate(ByteTokenizer):
    def render_chat(self, messages, add_generation_prompt, tools=None):  # type: ignore[override]
        raise ChatTemplateError("chat: the template says: only user and assistant turns alternate")


def test_a_chat_the_template_refuses_is_invalid_argument_on_chat() -> None:
    req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")]))
    with pytest.raises(InvalidArgument, match="prompt.chat: chat: the template says: only user") as info:
        prepare(req, _RefusingTemplate(), CFG, 4096)
    assert info.value.field == "prompt.chat"


LIMITS = [
    (_req(stop_token_ids=[1, 2, 3, 4]), "sampling.stop_token_ids: too many stop token ids: 4 > 3 (max_stop_token_ids)"),
    (_req(stop=["a", "b", "c"]), "sampling.stop: too many stop strings: 3 > 2 (max_stop_strings)"),
    (_req(stop=["x" * 9]), "sampling.stop[0]: longer than 8 characters (max_stop_len)"),
    (pb.GenerateRequest(text="é" * 21), "prompt.text: 21 characters is longer than the limit of 20 (max_prompt_chars)"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")] * 4)),
     "prompt.chat.messages: 4 messages is more than the limit of 3 (max_chat_messages)"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x" * 7)] * 2)),
     "prompt.chat: 22 characters is longer than the limit of 20 (max_prompt_chars)"),
]


@pytest.mark.parametrize(("request_", "message"), LIMITS, ids=[m.split(":")[0] for _, m in LIMITS])
def test_limit_errors_name_the_limit_and_its_setting(request_: pb.GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        prepare(request_, TOK, CFG, context_len=4096)
    assert str(info.value) == message


def test_requests_at_the_limits_pass() -> None:
    prep = prepare(pb.GenerateRequest(text="é" * 20, sampling=pb.SamplingParams(stop_token_ids=[1, 2, 3])),
                   TOK, CFG, context_len=4096)
    assert len(prep.prompt_ids) == 40 and prep.params.stop_token_ids == [1, 2, 3]
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="x" * 2)] * 3)  # 3 * (4 + 2) = 18
    assert bytes(prepare(pb.GenerateRequest(chat=chat), TOK, CFG, 4096).prompt_ids).startswith(b"<user>xx\n")


class _CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return super().encode(text)


def test_size_limits_are_checked_before_tokenizing() -> None:
    tok = _CountingTokenizer()
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="x" * 30)])
    for req in (pb.TokenizeRequest(text="x" * 21), pb.TokenizeRequest(chat=chat)):
        with pytest.raises(InvalidArgument, match="max_prompt_chars"):
            prompt_ids(req, tok, CFG, oneof="input")
    assert tok.calls == 0
    assert prompt_ids(pb.TokenizeRequest(text="x" * 20), tok, CFG, oneof="input") == [ord("x")] * 20
    assert tok.calls == 1
