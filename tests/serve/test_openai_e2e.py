"""The OpenAI HTTP face of a real `kvserve serve` (memsvc, runner, frontend; the embedded
default model), driven by the official `openai` SDK: chat and completions, streamed and
not; greedy output equal token for token to gRPC's; errors as the SDK's exception types;
the prefix cache in usage.prompt_tokens_details.cached_tokens; a dropped connection counted
as an abort; `kvserve bench --api openai` against it."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvserve.model.tokenizer import load_frontend_tokenizer
from kvserve.tools import bench
from kvserve.v1 import generator_pb2 as pb
from tests.faults.harness import Service, start_serve, stop_serve

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    # float32 weights (not `auto`'s int4): the faces' logprobs are compared to 1e-4, and int4's
    # bfloat16 activations move them ~1e-3 between a cold prefill and a cached prefix
    svc = start_serve(tmp_path_factory.mktemp("serve-rt"), None, "--kv-tokens", "16384",
                      "--quantization", "none", ready_s=600.0, http=True)
    yield svc
    assert stop_serve(svc) == 0


def test_chat_and_completion_streamed_and_whole(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=16, temperature=0)
    assert "Paris" in whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=FRANCE, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 8


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_greedy_http_equals_grpc_token_for_token(service: Service, client: openai.OpenAI, model: str,
                                                 kind: str) -> None:
    n = 24
    sampling = pb.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
    if kind == "chat":
        req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in FRANCE]), sampling=sampling)
        got = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=n, temperature=0,
                                             logprobs=True, extra_body={"ignore_eos": True})
        http_text = got.choices[0].message.content
        http_tokens = [c.token for c in got.choices[0].logprobs.content]
        http_lps = [c.logprob for c in got.choices[0].logprobs.content]
    else:
        req = pb.GenerateRequest(text="Once upon a time", sampling=sampling)
        got = client.completions.create(model=model, prompt="Once upon a time", max_tokens=n, temperature=0,
                                        logprobs=0, extra_body={"ignore_eos": True})
        http_text = got.choices[0].text
        http_tokens = got.choices[0].logprobs.tokens
        http_lps = got.choices[0].logprobs.token_logprobs
    msgs = list(service.stub.Generate(req, timeout=300))
    ids = [t for m in msgs for t in m.token_ids]
    tok = load_frontend_tokenizer("", "")
    assert len(ids) == n == got.usage.completion_tokens
    assert http_tokens == [tok.decode([i]) for i in ids]
    assert http_text == "".join(m.text for m in msgs)
    assert http_lps == pytest.approx([lp.logprob for m in msgs for lp in m.logprobs], abs=1e-4)


def test_errors_are_the_sdks_exception_types(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert bad.value.param == "temperature" and "must be >= 0" in bad.value.message
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=model, messages=FRANCE, max_completion_tokens=10**6)
    assert long.value.param == "max_completion_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=model + "-nope", prompt="hi")


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    prompt = "kvserve keeps the KV cache in a process of its own. " * 30  # a few hundred tokens
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 256
    assert second.usage.prompt_tokens_details.cached_tokens >= 256


def test_dropped_connection_counts_as_abort(service: Service, model: str) -> None:
    before = service.metric(0, 'kvserve_requests_total{finish_reason="abort"}')
    body = json.dumps({"model": model, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", service.http_port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += sock.recv(65536)
    deadline = time.monotonic() + 10
    while service.metric(0, 'kvserve_requests_total{finish_reason="abort"}') < before + 1:
        assert time.monotonic() < deadline, "the dropped stream was not counted as an abort"
        time.sleep(0.05)
    while service.metric(1, 'kvserve_kv_cache_slots{state="request"}') != 0:  # its slots are freed
        assert time.monotonic() < deadline, "the aborted request kept its KV slots"
        time.sleep(0.05)


def test_bench_drives_the_openai_face(service: Service, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc = bench.main(["--api", "openai", "--url", service.url, "--concurrency", "2", "--num-requests", "4",
                     "--prompt-len", "16", "--output-len", "8", "--quiet", "--json", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["status"], r["output_tokens"], r["prompt_tokens"]) for r in records] == [("OK", 8, 16)] * 4
    assert all(r["first_token"] is not None and r["end"] > r["first_token"] for r in records)
