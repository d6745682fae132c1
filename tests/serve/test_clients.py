"""Real client libraries against a real `kvserve serve` (memsvc, runner, frontend; the embedded
default model, an instruct model that writes sensible JSON and closes it): the openai SDK's
structured-output helpers (`chat.completions.parse` and `.stream` with a pydantic model, greedy
and seeded, and a plain stream whose deltas parse and validate), langchain-openai's
`with_structured_output` (json_schema and json_mode), and guidellm's CLI benchmarking the chat
and completion routes, its counts checked against the server's own usage and counters.

Tool calling's clients (the SDK's streamed calls, langchain's `bind_tools`) are in test_tools.py,
on a model whose template writes calls."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai.types.chat import ParsedChatCompletion
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from kvserve.model.files import resolve_model
from kvserve.model.tokenizer_cache import ensure_cached
from tests.faults.harness import DEFAULT_PATH, Service, start_serve, stop_serve

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


class Landmark(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=32)
    year_built: int = Field(ge=0, le=2100)


class City(BaseModel):
    """A capital city, as the model describes it."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=32)
    country: str = Field(max_length=32)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]
    landmarks: list[Landmark] = Field(min_length=1, max_length=2)


class Place(BaseModel):
    city: str
    country: str


ASK = ("Describe the capital of France in JSON: its city, country, continent and one or two landmarks "
       "with the year each was built.")
MESSAGES = [{"role": "user", "content": ASK}]
ASK_JSON = "What is the capital of France? Answer in JSON with the keys city and country."
MAX_TOKENS = 128  # the City objects above close in 48-66 tokens
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1.0, "seed": 1}
CITY_FORMAT = {"type": "json_schema",
               "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True}}

# guidellm's run: a few short requests, each exactly OUTPUT tokens (it sends ignore_eos)
REQUESTS, PROMPT, OUTPUT = 4, 16, 8


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_serve(tmp_path_factory.mktemp("clients-rt"), None, "--kv-tokens", "16384", *DEFAULT_PATH,
                      dtype=None, http=True, ready_s=600.0)
    try:
        yield svc
    finally:
        assert stop_serve(svc) == 0


def _parse(client: openai.OpenAI, model: str, sampling: dict) -> ParsedChatCompletion[City]:
    return client.chat.completions.parse(model=model, messages=MESSAGES, response_format=City,
                                         max_tokens=MAX_TOKENS, **sampling)


def test_sdk_parse_greedy(client: openai.OpenAI, model: str) -> None:
    got = _parse(client, model, GREEDY)
    choice = got.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed == City.model_validate_json(choice.message.content)
    assert (choice.message.parsed.city, choice.message.parsed.continent) == ("Paris", "Europe")
    assert _parse(client, model, GREEDY).choices[0].message.content == choice.message.content


def test_sdk_parse_seeded(client: openai.OpenAI, model: str) -> None:
    contents = []
    for seed in range(4):
        choice = _parse(client, model, {"temperature": 1.0, "seed": seed}).choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)
        assert choice.message.parsed == City.model_validate_json(choice.message.content)
        contents.append(choice.message.content)
    assert _parse(client, model, {"temperature": 1.0, "seed": 0}).choices[0].message.content == contents[0]
    assert len(set(contents)) > 1  # the seeds draw, they are not one forced string


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_sdk_streams(client: openai.OpenAI, model: str, sampling: dict) -> None:
    whole = _parse(client, model, sampling)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, response_format=CITY_FORMAT,
                                                 max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}, **sampling))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), City.model_json_schema())
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    # the SDK's own streaming helper parses the same object at its end
    with client.chat.completions.stream(model=model, messages=MESSAGES, response_format=City,
                                        max_tokens=MAX_TOKENS, **sampling) as stream:
        done = [e.parsed for e in stream if e.type == "content.done"]
        final = stream.get_final_completion()
    assert done == [whole.choices[0].message.parsed]
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed


def _chat(service: Service, model: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=service.url + "/v1", api_key="unused", model=model, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=300)


def test_langchain_json_schema(service: Service, client: openai.OpenAI, model: str) -> None:
    # json_schema is langchain-openai 1.x's default, named here; function_calling sends `tools`,
    # which SmolLM2's template does not render (a 400: test_tools.py has a model that does)
    structured = _chat(service, model).with_structured_output(City, method="json_schema", include_raw=True)
    out = structured.invoke(ASK)
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], City)
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    # the same greedy request as the SDK's parse: the same object, token for token
    sdk = _parse(client, model, GREEDY).choices[0].message
    assert out["raw"].content == sdk.content
    assert out["parsed"] == sdk.parsed


def test_langchain_json_mode(service: Service, client: openai.OpenAI, model: str) -> None:
    structured = _chat(service, model).with_structured_output(Place, method="json_mode", include_raw=True)
    out = structured.invoke(ASK_JSON)
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], Place) and out["parsed"].city == "Paris"
    assert json.loads(out["raw"].content) == out["parsed"].model_dump()
    sdk = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ASK_JSON}],
                                         response_format={"type": "json_object"}, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert out["raw"].content == sdk.choices[0].message.content


def _counters(service: Service) -> dict[str, float]:
    return {"length": service.metric(0, 'kvserve_requests_total{finish_reason="length"}'),
            "generated": service.metric(0, "kvserve_generation_tokens_total"),
            "prompt": service.metric(0, "kvserve_prompt_tokens_total"),
            "errors": service.metric(0, "kvserve_request_errors_total")}


def _private_shm() -> list[str]:
    """A prefix that runs a command with a /dev/shm of its own, where the machine allows it.
    guidellm's worker processes (multiprocessing, spawn) hold named semaphores in /dev/shm while
    they run; in the shared one they would show up in the leak checks of the serve tests running
    beside this one on the other xdist worker (tests/faults/test_crash.py saw them)."""
    probe = ["unshare", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
    if shutil.which("unshare") and subprocess.run(probe, capture_output=True).returncode == 0:
        return ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "guidellm"]
    return []


def _rendered(service: Service, route: str, body: dict) -> list[int]:
    resp = httpx.post(service.url + route + "/render", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["token_ids"]


@pytest.mark.parametrize(("route", "profile", "strategy"), [
    ("/v1/completions", "kind=constant,rate=4", "constant"),
])
def test_guidellm_benchmark(service: Service, model: str, tmp_path: Path, route: str, profile: str,
                            strategy: str) -> None:
    tokenizer_dir = ensure_cached(resolve_model(None))  # the default GGUF's HF tokenizer directory
    report = tmp_path / "benchmarks.json"
    before = _counters(service)
    proc = subprocess.run(
        [*_private_shm(), sys.executable, "-m", "guidellm", "run",
         "--backend", f"kind=openai_http,target={service.url},model={model},request_format={route}",
         "--profile", profile,
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT},output_tokens={OUTPUT}",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
         "--output", f"kind=json,path={report}",
         "--disable-console"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, GUIDELLM__MAX_WORKER_PROCESSES="2", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    after = _counters(service)

    [bench] = json.loads(report.read_text())["benchmarks"]
    assert bench["config"]["strategy"]["type_"] == strategy
    assert bench["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                  "total": REQUESTS}
    done = bench["requests"]["successful"]
    assert [r["output_metrics"]["text_tokens"] for r in done] == [OUTPUT] * REQUESTS
    # guidellm's prompt counts (from the server's usage) are the ids the server renders for its bodies
    bodies = [json.loads(r["request_args"])["body"] for r in done]
    prompts = [r["input_metrics"]["text_tokens"] for r in done]
    assert prompts == [len(_rendered(service, route, b)) for b in bodies]
    if route == "/v1/completions":
        # guidellm drew each prompt to PROMPT tokens with the tokenizer it was given; the server agrees
        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        assert [tok.encode(b["prompt"], add_special_tokens=False).ids for b in bodies] == \
            [_rendered(service, route, b) for b in bodies]
        assert prompts == [PROMPT] * REQUESTS
    assert {k: after[k] - before[k] for k in after} == {"length": REQUESTS, "generated": REQUESTS * OUTPUT,
                                                         "prompt": sum(prompts), "errors": 0}
