"""The OpenAI HTTP face of a real `kvserve frontend` process (byte tokenizer, fake runners),
driven by the official `openai` SDK and by raw HTTP: shapes, streaming, the sampling fields
as the runner receives them, errors as OpenAI error objects and SDK exceptions, ignored
fields counted, limits (413, 429, 503), auth (401, /health open), aborts on disconnect,
render/tokenize/detokenize. The real model behind the same face: tests/serve/test_openai_e2e.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from kvserve.messages.frontend_runner import GenerateReq
from kvserve.v1 import generator_pb2 as pb

from .conftest import Frontend, start_frontend, stop_frontend
from .fake_runner import FakeRunner, fake_logprob

pytestmark = pytest.mark.timeout(120)
NAME = "tiny-bytes"
REPLY = "Hello, wörld! 你好 and more text to fill the stream."


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    fe = start_frontend(tmp_path_factory.mktemp("rt"), "--served-model-name", NAME, "--max-waiting", "4",
                        "--max-message-bytes", "65536", http=True, metrics=True)
    yield fe
    assert stop_frontend(fe) == 0


@pytest.fixture
def fakes(api: Frontend) -> Iterator[list[FakeRunner]]:
    made: list[FakeRunner] = []
    yield made
    for r in made:
        r.kill()
    assert api.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING)


def _live(api: Frontend, fakes: list[FakeRunner], **kw) -> FakeRunner:
    r = api.runner(f"r{len(fakes)}-{time.monotonic_ns()}", **kw)
    fakes.append(r)
    assert api.wait_health(health_pb2.HealthCheckResponse.SERVING)
    return r


def _sdk(api: Frontend, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                         timeout=30, **kw)


def _metric(api: Frontend, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{api.metrics_port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _last_req(r: FakeRunner) -> GenerateReq:
    assert r.wait_for(lambda: r.generate_reqs())
    return r.generate_reqs()[-1]


# ---- shapes ---------------------------------------------------------------------------------


def test_health_models_version(api: Frontend, fakes: list[FakeRunner]) -> None:
    health = httpx.get(api.url + "/health")
    assert health.status_code == 503 and health.json()["error"]["message"] == "no live runner"
    _live(api, fakes)
    assert httpx.get(api.url + "/health").status_code == 200
    models = _sdk(api).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].max_model_len == 4096 and models.data[0].owned_by == "kvserve"
    from kvserve import __version__
    assert httpx.get(api.url + "/version").json() == {"version": __version__}


def test_router_discovery_endpoints(api: Frontend, tmp_path: Path) -> None:
    """What vllm-router's kv_aware discovery reads: the model, this incarnation and the block
    size; the KV-event sockets keyed by rank, none when memsvc does not publish."""
    from kvserve import __version__
    info = httpx.get(api.url + "/get_server_info").json()
    assert info == {"model_id": NAME, "model_path": "bytes", "instance_id": info["instance_id"],
                    "kv_block_size": 16, "max_model_len": 4096, "version": __version__}
    assert info["instance_id"].startswith(NAME + "-") and len(info["instance_id"]) > len(NAME) + 8
    assert httpx.get(api.url + "/kv_event_sources").json() == {}
    live, replay = "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"
    fe = start_frontend(tmp_path / "rt", "--kv-events-endpoint", live, "--kv-events-replay-endpoint", replay,
                        "--kv-event-block-size", "32", http=True)
    try:
        assert httpx.get(fe.url + "/kv_event_sources").json() == {"0": {
            "endpoint": live, "replay_endpoint": replay, "topic": "", "publisher": "zmq", "encoding": "msgpack",
            "schema_version": 1, "enable_kv_cache_events": True, "block_size": 32}}
        other = httpx.get(fe.url + "/get_server_info").json()
        assert other["kv_block_size"] == 32 and other["instance_id"] != info["instance_id"]
    finally:
        assert stop_frontend(fe) == 0


def test_completion_whole_and_streamed(api: Frontend, fakes: list[FakeRunner]) -> None:
    _live(api, fakes)
    client = _sdk(api)
    got = client.completions.create(model=NAME, prompt="hi", max_tokens=5, temperature=0)
    assert got.object == "text_completion" and got.model == NAME and got.id.startswith("cmpl-")
    assert abs(got.created - time.time()) < 60
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [(0, "Hello", "length")]
    assert got.usage.prompt_tokens == 2 and got.usage.completion_tokens == 5 and got.usage.total_tokens == 7
    assert got.usage.prompt_tokens_details.cached_tokens == 2  # what the runner reported

    chunks = list(client.completions.create(model=NAME, prompt=[104, 105], max_tokens=100, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"  # EOS
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(REPLY.encode()) + 1
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_chat_whole_and_streamed(api: Frontend, fakes: list[FakeRunner]) -> None:
    r = _live(api, fakes)
    client = _sdk(api)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == "Hello"
    assert got.choices[0].finish_reason == "length"
    # the chat went through the model's template: the same ids /tokenize gives for it
    ids = httpx.post(api.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert _last_req(r).token_ids == ids and "a\nb" in bytes(ids).decode()
    assert got.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, wö"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len(ids)


def test_sse_bytes_end_with_done(api: Frontend, fakes: list[FakeRunner]) -> None:
    _live(api, fakes)
    with httpx.stream("POST", api.url + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": 3, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]) == "Hel"


def test_stop_strings_and_logprobs(api: Frontend, fakes: list[FakeRunner]) -> None:
    _live(api, fakes, with_logprobs=True)
    client = _sdk(api)
    got = client.completions.create(model=NAME, prompt="hi", max_tokens=40, stop=[", w"])
    assert got.choices[0].text == "Hello" and got.choices[0].finish_reason == "stop"

    got = client.completions.create(model=NAME, prompt="hi", max_tokens=3, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.tokens == ["H", "e", "l"] and lp.text_offset == [0, 1, 2]
    assert lp.token_logprobs == [pytest.approx(fake_logprob(t, 2).logprob) for t in b"Hel"]
    want = fake_logprob(ord("H"), 2)
    assert lp.top_logprobs[0] == {bytes([i]).decode("utf-8", "replace"): pytest.approx(v)
                                  for i, v in zip(want.top_ids, want.top_logprobs, strict=True)}
    got = client.completions.create(model=NAME, prompt="hi", max_tokens=2, logprobs=0)
    assert got.choices[0].logprobs.top_logprobs == [{}, {}] and len(got.choices[0].logprobs.token_logprobs) == 2

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == ["H", "e"] and [len(c.top_logprobs) for c in content] == [3, 3]
    assert content[0].bytes == [72] and content[0].logprob == pytest.approx(fake_logprob(72, 3).logprob)
    plain = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_sampling_fields_reach_the_runner(api: Frontend, fakes: list[FakeRunner]) -> None:
    r = _live(api, fakes)
    client = _sdk(api)
    client.completions.create(
        model=NAME, prompt="hi", max_tokens=3, temperature=0.5, top_p=0.75, seed=-1, presence_penalty=0.25,
        frequency_penalty=0.5, stop=["zz"],
        extra_body={"top_k": -1, "min_p": 0.125, "repetition_penalty": 1.25, "stop_token_ids": [7, 9],
                    "ignore_eos": True})
    p = _last_req(r).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.75, 0, 0.125)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.25, 0.5, 1.25)
    assert (p.seed, p.max_new_tokens, p.stop_token_ids, p.ignore_eos) == (2**64 - 1, 3, [7, 9], True)
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=50,
                                   max_completion_tokens=4, extra_body={"top_k": 5})
    p = _last_req(r).params
    assert (p.temperature, p.top_k, p.max_new_tokens, p.seed, p.ignore_eos) == (1.0, 5, 4, None, False)
    assert (p.grammar, p.logit_bias) == ("", {})
    client.completions.create(model=NAME, prompt="hi", max_tokens=2, logit_bias={"104": -100, "7": 2.5},
                              extra_body={"structured_outputs": {"regex": "[a-z]+"}})
    p = _last_req(r).params
    assert p.logit_bias == {104: -100.0, 7: 2.5} and "[a-z]+" in p.grammar


def test_echo_and_n(api: Frontend, fakes: list[FakeRunner]) -> None:
    _live(api, fakes)
    client = _sdk(api)
    got = client.completions.create(model=NAME, prompt="hi", max_tokens=2, echo=True)
    assert got.choices[0].text == "hiHe"
    streamed = client.completions.create(model=NAME, prompt=[104, 105], max_tokens=2, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "hiHe"
    many = client.completions.create(model=NAME, prompt="hi", max_tokens=2, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2] and {c.text for c in many.choices} == {"He"}
    assert many.usage.completion_tokens == 6 and many.usage.prompt_tokens == 2
    running = list(client.completions.create(model=NAME, prompt="hi", max_tokens=2, stream=True,
                                             stream_options={"continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in running if c.choices] == [1, 2]
    resp = httpx.post(api.url + "/v1/completions", json={"prompt": "hi", "stream": True,
                                                         "stream_options": {"made_up": True}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options.made_up"


def _choices_until(lines: Iterator[str], done: Callable[[dict], bool]) -> dict[int, list[str | None]]:
    """Each choice's streamed pieces (its text, then its finish_reason) from the event stream's
    `lines`, read until `done(seen)` (the stream stays open: breaking out of iter_lines closes it)."""
    seen: dict[int, list[str | None]] = {}
    for line in lines:
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                seen.setdefault(c["index"], []).append(c["finish_reason"] or c["text"])
            if done(seen):
                break
    return seen


def test_n_takes_its_seats_at_admission_and_abort_stops_every_choice(api: Frontend, fakes: list[FakeRunner]) -> None:
    r = _live(api, fakes, hold=True)  # answers nothing yet: every admitted choice stays waiting (limit 4)
    with httpx.Client(base_url=api.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "p", "n": 2, "stream": True},
                           headers={"X-Request-Id": "two"}) as held:
            assert held.status_code == 200
            assert r.wait_for(lambda: len(r.generate_reqs()) == 1)  # choice 1 waits for choice 0's first token
            assert _metric(api, "kvserve_num_requests_waiting") == 1
            over = client.post("/v1/completions", json={"prompt": "q", "n": 3})  # 2 seats taken, 2 left
            assert over.status_code == 429 and "waiting queue is full" in over.json()["error"]["message"]
            never = client.post("/v1/completions", json={"prompt": "q", "n": 5})
            assert never.status_code == 400 and never.json()["error"]["param"] == "n"
            assert "more than the 4 streams" in never.json()["error"]["message"]
            # aborted before its first token: choice 1, never admitted, ends as aborted too
            assert api.stub.Abort(pb.AbortRequest(request_id="two"), timeout=5).aborted
            aborted = lambda s: len(s) == 2 and all(v[-1] == "abort" for v in s.values())  # noqa: E731
            assert _choices_until(held.iter_lines(), aborted) == {0: ["abort"], 1: ["abort"]}
        r.hold = False
        long = {"prompt": "q", "n": 2, "stream": True, "max_tokens": 1000, "ignore_eos": True}  # 20 s
        with client.stream("POST", "/v1/completions", json=long, headers={"X-Request-Id": "run"}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert _choices_until(lines, lambda s: len(s) == 2)  # both choices stream
            assert (_metric(api, "kvserve_num_requests_running"), _metric(api, "kvserve_num_requests_waiting")) == (2, 0)
            assert api.stub.Abort(pb.AbortRequest(request_id="run"), timeout=5).aborted
            assert {i: v[-1] for i, v in _choices_until(lines, aborted).items()} == {0: "abort", 1: "abort"}
    def received() -> set[str]:
        return {m.request_id for m in r.generate_reqs()}
    # every choice the runner was given was aborted: two's choice 0 (its choice 1 never ran), run's two
    assert r.wait_for(lambda: set(r.aborts()) == received(), timeout=15), (r.aborts(), received())
    assert len(received()) == 3, received()
    assert (_metric(api, "kvserve_num_requests_running"), _metric(api, "kvserve_num_requests_waiting")) == (0, 0)
    with pytest.raises(grpc.RpcError) as err:
        next(iter(api.stub.Generate(pb.GenerateRequest(request_id="a\x1f1", text="hi"), timeout=5)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id: holds a control character" in err.value.details()


# ---- errors ---------------------------------------------------------------------------------


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "hi", "top_p": 7}, "top_p", "must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "must be in 1..4096"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": [104, 999]}, "prompt[1]", "out of vocabulary"),
    ("/v1/completions", {"prompt": ""}, "prompt", "empty prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "2 prompts in one request"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "must be in 1..128"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n", "must be in 1..128"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo", "not supported"),
    ("/v1/completions", {"prompt": "hi", "include_stop_str_in_output": True}, "include_stop_str_in_output",
     "not supported"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 3}, "min_tokens", "not supported"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [104]}, "allowed_token_ids", "not supported"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["x"]}, "bad_words", "not supported"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 0}, "prompt_logprobs", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern", "not supported"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo",
     "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "maybe"},
     "tool_choice", "Input should be"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "0..20"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed", "less than or equal"),
    ("/v1/completions", {}, "prompt", "Field required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "empty chat"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role",
     "unknown chat role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0].function", "Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}, "tools",
     "writes calls in no format kvserve reads"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tools", "writes calls in no format kvserve reads"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
     "max_completion_tokens", "must be in 1..4096"),
    ("/tokenize", {"prompt": "x", "messages": []}, "prompt", "exactly one of"),
    ("/detokenize", {"tokens": [1, 300]}, "tokens[1]", "out of vocabulary"),
])
def test_bad_fields_are_400_naming_the_field(api: Frontend, fakes: list[FakeRunner], path: str, body: dict,
                                             param: str, says: str) -> None:
    r = _live(api, fakes)
    resp = httpx.post(api.url + path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"]
    assert err["message"].startswith(param)
    assert r.generate_reqs() == []  # nothing reached a runner


def test_malformed_json_and_non_object_bodies(api: Frontend) -> None:
    for body, says in ((b"{bad", "malformed JSON body"), (b"[1, 2]", "must be a JSON object"), (b"", "malformed JSON")):
        resp = httpx.post(api.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text


def test_sdk_exception_types(api: Frontend, fakes: list[FakeRunner]) -> None:
    client = _sdk(api)
    with pytest.raises(openai.InternalServerError) as unavailable:  # 503: no live runner
        client.completions.create(model=NAME, prompt="hi")
    assert unavailable.value.status_code == 503 and "no live runner" in unavailable.value.message
    _live(api, fakes)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=NAME, prompt="hi", top_p=2.0)
    assert bad.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found" and "gpt-9" in missing.value.message


def test_router_fields_accepted_ignored_and_counted(api: Frontend, fakes: list[FakeRunner]) -> None:
    _live(api, fakes)
    before = {f: _metric(api, "kvserve_frontend_http_ignored_fields_total", field=f)
              for f in ("no_stop_trim", "skip_special_tokens", "other")}
    # what vllm-router adds when it re-serializes a request (ROUTER.md), and a field nobody knows
    extra = {"echo": False, "ignore_eos": False, "no_stop_trim": False, "skip_special_tokens": True,
             "return_hidden_states": False, "stream": False, "made_up_field": 1}
    resp = httpx.post(api.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "He"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": False,
            "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
            "include_reasoning": True, **extra}
    assert httpx.post(api.url + "/v1/chat/completions", json=chat).status_code == 200
    assert httpx.post(api.url + "/v1/chat/completions/render", json=chat).status_code == 200
    after = {f: _metric(api, "kvserve_frontend_http_ignored_fields_total", field=f) for f in before}
    assert after["no_stop_trim"] - before["no_stop_trim"] == 3
    assert after["skip_special_tokens"] - before["skip_special_tokens"] == 3
    assert after["other"] - before["other"] == 3  # made_up_field, once per request


def test_body_over_the_limit_is_413(api: Frontend, fakes: list[FakeRunner]) -> None:
    r = _live(api, fakes)
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    resp = httpx.post(api.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "65536 (max_message_bytes)" in resp.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no content-length: counted while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    resp = httpx.post(api.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert r.generate_reqs() == []


def test_overload_is_429_and_render_does_not_queue_behind_generation(api: Frontend, fakes: list[FakeRunner]) -> None:
    r = _live(api, fakes, hold=True)  # accepts requests, never answers: all four stay waiting
    with httpx.Client(base_url=api.url, timeout=30) as client:
        streams = [client.stream("POST", "/v1/completions", json={"prompt": f"p{i}", "stream": True})
                   for i in range(4)]
        for s in streams:
            assert s.__enter__().status_code == 200
        assert r.wait_for(lambda: len(r.generate_reqs()) == 4)
        over = client.post("/v1/completions", json={"prompt": "one too many"})
        assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
        assert "waiting queue is full" in over.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            _sdk(api).completions.create(model=NAME, prompt="again")
        t0 = time.monotonic()
        rendered = client.post("/v1/chat/completions/render",
                               json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert time.monotonic() - t0 < 1.0 and rendered.status_code == 200
        for s in streams:
            s.__exit__(None, None, None)
    assert r.wait_for(lambda: len(r.aborts()) == 4)


def test_render_gives_exactly_the_ids_the_runner_prefills(api: Frontend, fakes: list[FakeRunner]) -> None:
    r = _live(api, fakes)
    chat = {"model": NAME, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hé"}]}
    rendered = httpx.post(api.url + "/v1/chat/completions/render", json=chat).json()["token_ids"]
    httpx.post(api.url + "/v1/chat/completions", json=chat | {"max_tokens": 1})
    assert _last_req(r).token_ids == rendered
    one = httpx.post(api.url + "/v1/completions/render", json={"prompt": "abc"}).json()
    assert one == {"token_ids": [97, 98, 99]}
    many = httpx.post(api.url + "/v1/completions/render", json={"prompt": ["ab", "cd"]}).json()
    assert many == [{"token_ids": [97, 98]}, {"token_ids": [99, 100]}]
    tok = httpx.post(api.url + "/tokenize", json={"prompt": "hé"}).json()
    assert tok == {"tokens": [104, 195, 169], "count": 3, "max_model_len": 4096}
    assert httpx.post(api.url + "/detokenize", json={"tokens": [104, 195, 169]}).json() == {"prompt": "hé"}


# ---- client gone ----------------------------------------------------------------------------


def _raw_request(api: Frontend, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", api.http_port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_within_a_step_and_counts_as_abort(api: Frontend, fakes: list[FakeRunner],
                                                             stream: bool) -> None:
    r = _live(api, fakes, step_s=0.05, reply="x" * 400)
    before = _metric(api, "kvserve_requests_total", finish_reason="abort")
    sock = _raw_request(api, {"prompt": "hi", "max_tokens": 400, "stream": stream})
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert r.wait_for(lambda: r.generate_reqs())
    time.sleep(0.3)
    wire_id = r.generate_reqs()[-1].request_id
    sock.close()
    t0 = time.monotonic()
    assert r.wait_for(lambda: wire_id in r.aborts(), timeout=2)
    assert time.monotonic() - t0 < 0.5  # a step is 50 ms here; allow for the loop and the poll
    assert _metric(api, "kvserve_requests_total", finish_reason="abort") == before + 1


# ---- auth and TLS ---------------------------------------------------------------------------


def test_bearer_token_on_http_and_open_health(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    fe = start_frontend(tmp_path / "rt", "--auth-token-file", str(token), http=True)
    r = fe.runner("auth-r")
    try:
        assert fe.wait_health(health_pb2.HealthCheckResponse.SERVING)
        assert httpx.get(fe.url + "/health").status_code == 200  # routers poll it without credentials
        for path in ("/v1/models", "/version"):
            resp = httpx.get(fe.url + path)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            _sdk(fe, api_key="wrong").completions.create(model="bytes", prompt="hi")
        got = _sdk(fe, api_key="s3cret").completions.create(model="bytes", prompt="hi", max_tokens=2)
        assert got.choices[0].text == "He"
    finally:
        r.kill()
        assert stop_frontend(fe) == 0


def test_taken_http_port_fails_at_once_naming_it(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "kvserve.cli", "frontend", "--tokenizer", "bytes", "--port",
                              "0", "--metrics-port", "0", "--http-port", str(port), "--runtime-dir",
                              str(tmp_path / "rt")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"--http-port: cannot listen on 127.0.0.1:{port}" in out.stderr
