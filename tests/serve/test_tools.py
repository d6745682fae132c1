"""Tool calling through a real `kvserve serve` (memsvc, runner, frontend) on a tiny random model
whose chat template writes Hermes-style calls: `tool_choice` required and named (constrained, so
every reply is calls whose arguments validate), the same calls streamed as OpenAI deltas
(accumulated by the openai SDK), `auto` read exactly as the family reads the same greedy text,
and langchain-openai's `bind_tools` round trip with the tool's result in the next turn."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from kvserve.model.tool_parsers import FAMILIES, Call, ToolStream
from tests.faults.harness import Service, start_serve, stop_serve
from tests.model.tinymodel import write_tiny_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TEMPLATE = (  # written for these tests: tools in a system turn, calls and results as Hermes writes them
    "{%- if tools %}<|bos|>system\nCall a function by writing <tool_call>\n{\"name\": ..., \"arguments\": ...}"
    "\n</tool_call>. Functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eos|>{% endif %}"
    "{%- for m in messages %}<|bos|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}<tool_response id=\"{{ m.tool_call_id }}\">{{ m.content }}</tool_response>"
    "{%- else %}{{ m.content }}{% endif %}<|eos|>{% endfor %}"
    "{%- if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK = {"temperature": 0, "max_tokens": 160}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    model = write_tiny_model(tmp_path_factory.mktemp("tools-model"), max_positions=2048)  # the tools fill 650 tokens
    (model / "chat_template.jinja").write_text(TEMPLATE)
    svc = start_serve(tmp_path_factory.mktemp("tools-rt"), model, http=True, ready_s=120.0)
    try:
        yield svc
    finally:
        assert stop_serve(svc) == 0


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_replies_with_one_call_that_validates(client: openai.OpenAI, model: str) -> None:
    for seed in range(3):  # one call allowed: the grammar's end leaves the model only its end of text
        got = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=160)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert len(choice.message.tool_calls or []) == 1
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        _valid(call.function.name, call.function.arguments)


def test_required_parallel_calls_each_validate(client: openai.OpenAI, model: str) -> None:
    ask = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300}
    greedy = client.chat.completions.create(**ask, temperature=0).choices[0].message.tool_calls or []
    assert len(greedy) >= 2  # this random model's greedy reply goes on calling
    sampled = [client.chat.completions.create(**ask, temperature=1.0, seed=seed).choices[0].message.tool_calls or []
               for seed in range(2)]
    for calls in [greedy, *sampled]:
        assert calls and len({c.id for c in calls}) == len(calls)
        for call in calls:
            _valid(call.function.name, call.function.arguments)


def test_a_named_function_is_the_one_call(client: openai.OpenAI, model: str) -> None:
    got = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, **ASK,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = got.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_time"]
    _valid("get_time", choice.message.tool_calls[0].function.arguments)
    assert choice.message.content is None


def test_streamed_calls_are_the_whole_replys_calls(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
          "parallel_tool_calls": False, **ASK}
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls or []
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert whole


def test_auto_reads_the_reply_as_the_family_does(service: Service, client: openai.OpenAI, model: str) -> None:
    got = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto", **ASK)
    ids = httpx.post(service.url + "/v1/chat/completions/render",
                     json={"model": model, "messages": MESSAGES, "tools": TOOLS}).json()["token_ids"]
    raw = client.completions.create(model=model, prompt=ids, **ASK).choices[0].text
    items = ToolStream(FAMILIES["hermes"]).push(raw, final=True)
    message = got.choices[0].message
    assert (message.content or "") == "".join(i for i in items if isinstance(i, str))
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == \
        [(i.name, i.arguments) for i in items if isinstance(i, Call)]


def test_a_strict_tool_constrains_auto_replies(client: openai.OpenAI, model: str) -> None:
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    for seed in range(4):
        got = client.chat.completions.create(model=model, messages=MESSAGES, tools=strict, tool_choice="auto",
                                             temperature=1.0, seed=seed, max_tokens=160)
        message = got.choices[0].message
        assert "<tool_call>" not in (message.content or "")  # any call the reply opens parses
        for call in message.tool_calls or []:
            _valid(call.function.name, call.function.arguments)


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)  # unbounded, the random model writes digits to its token limit


@tool(args_schema=Forecast)
def get_weather(city: str, days: int) -> str:
    """The forecast for a city over some days."""
    return f"{city}: sunny for {days} days"


def test_langchain_bind_tools_round_trip(service: Service, model: str) -> None:
    llm = ChatOpenAI(base_url=service.url + "/v1", api_key="unused", model=model, temperature=0, max_tokens=160,
                     max_retries=0)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    asked = HumanMessage("What is the weather in Paris?")
    first = bound.invoke([asked])
    assert [c["name"] for c in first.tool_calls] == ["get_weather"]
    call = first.tool_calls[0]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    second = llm.invoke([asked, first, result])
    # the tool's answer reached the prompt: the server counted the turn as the template renders it
    rendered = httpx.post(service.url + "/v1/chat/completions/render", json={"model": model, "messages": [
        {"role": "user", "content": asked.content},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call["id"], "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(call["args"])}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": result.content}]}).json()["token_ids"]
    assert second.response_metadata["token_usage"]["prompt_tokens"] == len(rendered)
    text = httpx.post(service.url + "/detokenize", json={"model": model, "tokens": rendered}).json()["prompt"]
    assert f'<tool_response id="{call["id"]}">{result.content}</tool_response>' in text


def test_none_renders_the_tools_and_replies_with_text(service: Service, client: openai.OpenAI, model: str) -> None:
    got = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", **ASK)
    ids = httpx.post(service.url + "/v1/chat/completions/render",
                     json={"model": model, "messages": MESSAGES, "tools": TOOLS}).json()["token_ids"]
    assert got.usage.prompt_tokens == len(ids)
    raw = client.completions.create(model=model, prompt=ids, **ASK).choices[0]
    choice = got.choices[0]
    assert choice.message.tool_calls is None
    assert (choice.message.content, choice.finish_reason) == (raw.text, raw.finish_reason)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice.function.name",
     "'get_date' is not one of the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be asked beside tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]}, "tools",
     "nowhere"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "named twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name",
     "String should match pattern"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{**CALL, "function": {
        "name": "get_time", "arguments": "{zone"}}]}]}, "messages[1].tool_calls[0].arguments", "not valid JSON"),
    ({"messages": [*MESSAGES, {"role": "user", "content": "x", "tool_call_id": "call_1"}]},
     "messages[1].tool_call_id", "only a tool message"),
])
def test_bad_tool_fields_are_400s_naming_them(service: Service, model: str, extra: dict, param: str,
                                             says: str) -> None:
    body = {"model": model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, **extra}
    got = httpx.post(service.url + "/v1/chat/completions", json=body)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param, error
    assert says in error["message"], error
