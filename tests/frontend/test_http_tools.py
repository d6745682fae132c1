"""ToolPlan's reading of a chat's tool fields (unit tests of the logic; the served behaviour is
tests/serve/test_tools.py): what constrains a reply, what is refused and named; and a real
frontend, on a tokenizer whose Mistral marker is a special token (it decodes to nothing), reading
a fake runner's reply into the same calls whole and streamed."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from grpc_health.v1 import health_pb2
from tokenizers import Tokenizer

from kvserve.frontend.http_errors import HTTPError
from kvserve.frontend.http_tools import ToolPlan
from kvserve.frontend.openai_models import ChatCompletionRequest
from kvserve.model.tool_parsers import FAMILIES
from kvserve.tools.tinymodel import write_tiny_model

from .conftest import Frontend, start_frontend, stop_frontend

HERMES = FAMILIES["hermes"]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}


def _body(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **kw})


@pytest.mark.parametrize(("kw", "constrained", "one"), [
    ({"tools": [TOOL]}, False, False),  # auto: the model decides, its calls are read
    ({"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False}, False, True),
    ({"tools": [TOOL], "tool_choice": "required"}, True, False),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, True, False),
    ({"tools": [{"type": "function", "function": {**TOOL["function"], "strict": True}}]}, True, False),
])
def test_what_constrains_a_reply(kw: dict, constrained: bool, one: bool) -> None:
    plan = ToolPlan.of(_body(**kw), HERMES, None, "")
    assert plan is not None and plan.family is HERMES
    assert (plan.constraint is not None, plan.one) == (constrained, one)
    if constrained:
        assert "<tool_call>" in plan.constraint.grammar


def test_no_tools_or_tool_choice_none_is_a_text_reply() -> None:
    assert ToolPlan.of(_body(), HERMES, None, "") is None
    assert ToolPlan.of(_body(tools=[TOOL], tool_choice="none"), HERMES, None, "") is None


@pytest.mark.parametrize(("kw", "family", "setting", "param", "says"), [
    ({"tools": [TOOL]}, HERMES, "none", "tools", "--tool-call-parser none"),
    ({"tools": [TOOL]}, None, "", "tools", "no format kvserve reads"),
    ({"tool_choice": "required"}, HERMES, "", "tool_choice", "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, HERMES, "",
     "tool_choice.function.name", "'g' is not one of the tools"),
])
def test_refusals_name_the_field(kw: dict, family: object, setting: str, param: str, says: str) -> None:
    with pytest.raises(HTTPError) as got:
        ToolPlan.of(_body(**kw), family, None, setting)
    assert (got.value.status, got.value.param) == (400, param)
    assert says in str(got.value)


MISTRAL_TEMPLATE = (  # written for this test: a Mistral-style template (its marker a special token)
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list"
    " | tojson }}{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}"
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
)


@pytest.fixture(scope="module")
def mistral_face(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Frontend, Tokenizer]]:
    from transformers import PreTrainedTokenizerFast

    d = write_tiny_model(tmp_path_factory.mktemp("mistral-model"))  # the frontend reads its config
    fast = PreTrainedTokenizerFast.from_pretrained(str(d))
    fast.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    fast.chat_template = MISTRAL_TEMPLATE
    fast.save_pretrained(str(d))
    fe = start_frontend(tmp_path_factory.mktemp("rt"), "--model", str(d), "--tokenizer", "", http=True)
    yield fe, Tokenizer.from_file(str(d / "tokenizer.json"))
    assert stop_frontend(fe) == 0


def test_a_special_marker_token_opens_the_calls_whole_and_streamed(mistral_face: tuple) -> None:
    fe, tok = mistral_face
    marker = tok.token_to_id("[TOOL_CALLS]")
    args = '[{"name": "f", "arguments": {"a": 1}}]'
    runner = fe.runner("r0", reply_ids=tok.encode("Sure.", add_special_tokens=False).ids + [marker]
                       + tok.encode(args, add_special_tokens=False).ids)
    try:
        assert fe.wait_health(health_pb2.HealthCheckResponse.SERVING)
        client = openai.OpenAI(base_url=fe.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        ask = {"model": client.models.list().data[0].id, "messages": [{"role": "user", "content": "x"}],
               "tools": [TOOL], "max_tokens": 100}
        whole = client.chat.completions.create(**ask).choices[0]
        with client.chat.completions.stream(**ask) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_completion().choices[0]
        for choice in (whole, streamed):
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Sure."
            assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("f", '{"a": 1}')]
            assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    finally:
        runner.kill()
