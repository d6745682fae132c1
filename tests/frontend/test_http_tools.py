"""ToolPlan's reading of a chat's tool fields (unit tests of the logic; the served behaviour is
tests/serve/test_tools.py): what constrains a reply, what is refused and named."""

from __future__ import annotations

import pytest

from kvserve.frontend.http_errors import HTTPError
from kvserve.frontend.http_tools import ToolPlan
from kvserve.frontend.openai_models import ChatCompletionRequest
from kvserve.model.tool_parsers import FAMILIES

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
