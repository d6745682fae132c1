"""The agents' OpenAI fields (structured outputs, logit_bias, n) through a real `kvserve serve`
(memsvc, a runner, the frontend) on the tiny random model (byte tokenizer) on the default path
(its 4-bit codes, batch-invariant): every output of a constrained request, greedy or sampled, over HTTP and gRPC,
parses and validates against its schema (or matches its regex, choice or grammar) and ends by
itself; a constraint that does not compile is a 400 naming the field the client used; an
unconstrained request beside constrained ones keeps its tokens; logit_bias moves tokens as
OpenAI's does; n choices share one prefill through the prefix cache, streamed or not."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import jsonschema
import pytest

from kvserve.v1 import generator_pb2 as pb
from tests.faults.harness import DEFAULT_PATH, Service, start_serve, stop_serve
from tests.runner.runner_procs import sharp_int4_tiny_dir

pytestmark = pytest.mark.timeout(300)

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "role": {"enum": ["admin", "user", "guest"]}}},
    "list": {"type": "array", "minItems": 1, "maxItems": 4,
             "items": {"type": "number", "minimum": -10, "maximum": 10}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["id", "tags", "owner"],
               "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                              "tags": {"type": "array", "maxItems": 3,
                                       "items": {"type": "string", "maxLength": 4}},
                              "owner": {"anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": False,
                                                                     "required": ["ok"],
                                                                     "properties": {"ok": {"type": "boolean"}}}]}}},
}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "SELECT " col (", " col)* " FROM " tbl\ncol ::= [a-z]{1,6}\ntbl ::= [a-z]{1,6}'
GRAMMAR_RE = r"SELECT [a-z]{1,6}(, [a-z]{1,6})* FROM [a-z]{1,6}"
SAMPLED = [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in range(4)]
MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    model: Path = sharp_int4_tiny_dir(tmp_path_factory)
    service = start_serve(tmp_path_factory.mktemp("structured-rt"), model, "--kv-tokens", "4096",
                          *DEFAULT_PATH, dtype=None, http=True)
    try:
        yield service
    finally:
        assert stop_serve(service) == 0


def _post(svc: Service, path: str, body: dict) -> httpx.Response:
    return httpx.post(svc.url + path, json={"max_tokens": 400, **body}, timeout=120)


def _text(resp: httpx.Response) -> tuple[str, str]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return (choice["message"]["content"] if "message" in choice else choice["text"]), choice["finish_reason"]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(svc: Service, name: str) -> None:
    schema = SCHEMAS[name]
    seen = set()
    for sampling in SAMPLED:
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        text, reason = _text(_post(svc, "/v1/chat/completions", {"messages": MESSAGES, "response_format": fmt,
                                                                 **sampling}))
        assert reason == "stop", (sampling, text)
        jsonschema.validate(json.loads(text), schema)
        seen.add(text)
        text, reason = _text(_post(svc, "/v1/completions", {"prompt": "data:", "structured_outputs": {"json": schema},
                                                            **sampling}))
        assert reason == "stop", (sampling, text)
        jsonschema.validate(json.loads(text), schema)
    assert len(seen) > 1  # the sampled outputs are not one forced string


def test_json_object_regex_choice_grammar(svc: Service) -> None:
    # Any JSON object has no bound on its size: a random model sampling at temperature 1 writes
    # one that ends only by chance, so here it is greedy (the real model samples it in
    # tests/serve/test_openai_e2e.py)
    text, reason = _text(_post(svc, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0,
                                                             "response_format": {"type": "json_object"}}))
    assert reason == "stop" and isinstance(json.loads(text), dict), text
    for sampling in SAMPLED:
        for body, check in (({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                            ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
                            ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
                            ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
                            ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
                            ({"ebnf": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t))):
            text, reason = _text(_post(svc, "/v1/completions", {"prompt": "q:", **body, **sampling}))
            assert reason == "stop" and check(text), (body, sampling, text)


def test_grpc_constraint(svc: Service) -> None:
    schema = SCHEMAS["person"]
    for seed in range(3):
        req = pb.GenerateRequest(text="data:", sampling=pb.SamplingParams(
            temperature=1.0, seed=seed, max_new_tokens=400, constraint=pb.Constraint(json_schema=json.dumps(schema))))
        outs = list(svc.stub.Generate(req, timeout=60))
        assert outs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(o.text for o in outs)), schema)
    req = pb.GenerateRequest(text="q", sampling=pb.SamplingParams(constraint=pb.Constraint(regex="a(b")))
    with pytest.raises(grpc.RpcError) as err:
        list(svc.stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("sampling.constraint.regex: cannot be compiled")


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type: strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "no choices given"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "Rule 'nothing' not found"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"regex": "a", "response_format": {"type": "json_object"}}, "regex", "give one"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "not a token id"),
    ({"structured_outputs": {"json": True}}, "structured_outputs", "a JSON object"),
    ({"json_schema": "[" * 3000 + "]" * 3000}, "json_schema", "cannot be compiled"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5]", "[-100, 100]"),
    ({"logit_bias": {"99999": 1}}, "logit_bias[99999]", "out of vocabulary"),
])
def test_bad_constraints_are_400_naming_the_field(svc: Service, body: dict, param: str, says: str) -> None:
    resp = _post(svc, "/v1/completions", {"prompt": "q", **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and says in err["message"] and err["message"].startswith(param), err


def test_free_request_beside_constrained_keeps_its_tokens(svc: Service) -> None:
    free = {"prompt": "The free one runs beside the others", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    alone = _text(_post(svc, "/v1/completions", free))[0]
    results: list[str] = []
    outputs: dict[int, tuple[str, float, float]] = {}  # seed -> (text, start, end)
    free_span: list[float] = []

    def constrained_one(s: int) -> None:
        start = time.monotonic()
        text = _text(_post(svc, "/v1/completions", {
            "prompt": f"data {s}:", "structured_outputs": {"json": SCHEMAS["nested"]}, "temperature": 1.0,
            "seed": s}))[0]
        outputs[s] = (text, start, time.monotonic())

    constrained = [threading.Thread(target=constrained_one, args=(s,)) for s in range(4)]
    for t in constrained:
        t.start()
    free_span.append(time.monotonic())
    results.append(_text(_post(svc, "/v1/completions", free))[0])
    free_span.append(time.monotonic())
    for t in constrained:
        t.join()
    assert results == [alone]
    for text, _, _ in outputs.values():  # the constrained ones are what they asked for
        jsonschema.validate(json.loads(text), SCHEMAS["nested"])
    # and they ran while the free one did (else the check above proved nothing)
    assert any(a < free_span[1] and b > free_span[0] for _, a, b in outputs.values())


def _ids(svc: Service, sampling: pb.SamplingParams) -> list[int]:
    outs = list(svc.stub.Generate(pb.GenerateRequest(text="bias", sampling=sampling), timeout=60))
    return [t for o in outs for t in o.token_ids]


def test_logit_bias(svc: Service) -> None:
    q = httpx.post(svc.url + "/tokenize", json={"prompt": "Q"}).json()["tokens"]
    assert len(q) == 1
    base = {"prompt": "bias", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    assert _text(_post(svc, "/v1/completions", {**base, "logit_bias": {str(q[0]): 100}}))[0] == "Q" * 12
    greedy = pb.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    plain = _ids(svc, greedy)
    banned = pb.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logit_bias={plain[0]: -100})
    got = _ids(svc, banned)
    assert plain[0] not in got and len(got) == 12
    sampled = pb.SamplingParams(temperature=1.0, seed=1, max_new_tokens=12, ignore_eos=True,
                                logit_bias={plain[0]: -100})
    assert plain[0] not in _ids(svc, sampled)


def _cached_total(svc: Service) -> float:
    return svc.metric(0, "kvserve_cached_prompt_tokens_total")


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_share_the_prompt(svc: Service, stream: bool) -> None:
    prompt = f"Four choices share this prompt, prefilled once ({stream}). " * 3
    n, max_tokens = 4, 10
    body = {"prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    before = _cached_total(svc)
    if stream:
        texts, reasons, usage = [""] * n, [None] * n, None
        with httpx.stream("POST", svc.url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    texts[c["index"]] += c["text"]
                    reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    else:
        got = _post(svc, "/v1/completions", body).json()
        texts = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
        reasons = [c["finish_reason"] for c in got["choices"]]
        usage = got["usage"]
        assert [c["index"] for c in got["choices"]] == list(range(n))
    prompt_tokens = len(httpx.post(svc.url + "/tokenize", json={"prompt": prompt}).json()["tokens"])
    assert reasons == ["length"] * n
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == n * max_tokens
    assert len(set(texts)) == n  # seeded choices differ from one another
    # the other three found the prompt's whole blocks in the prefix cache (blocks of 16), read
    # before the n = 1 request below adds its own hit
    assert _cached_total(svc) - before >= (n - 1) * (prompt_tokens // 16 * 16 - 16)
    # choice 0 alone with the same seed is what an n = 1 request draws
    single = _text(_post(svc, "/v1/completions", {**body, "n": 1, "stream": False}))[0]
    assert single == texts[0]


def test_n_chat_greedy_choices_are_equal(svc: Service) -> None:
    got = _post(svc, "/v1/chat/completions", {"messages": MESSAGES, "n": 3, "temperature": 0, "max_tokens": 8,
                                              "ignore_eos": True}).json()
    contents = [c["message"]["content"] for c in got["choices"]]
    assert len(contents) == 3 and len(set(contents)) == 1 and got["usage"]["completion_tokens"] == 24
