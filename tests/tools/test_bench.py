"""Logic of the `kvserve bench` load generator, and its OpenAI mode against a stand-in server.

The stand-in (a tiny FastAPI app) only checks the client's logic; it is not kvserve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading

import pytest

from kvserve.tools.bench import build_parser, main
from kvserve.tools.bench_openai import parse_completion_stream
from kvserve.tools.bench_report import Record, format_table, plot, summarize
from kvserve.tools.bench_workload import _parse_range, make_workloads


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_ranges() -> None:
    assert _parse_range("32:512", "x") == (32, 512)
    assert _parse_range("7", "x") == (7, 7)
    for bad in ("0", "9:3", "a", "1:2:3"):
        with pytest.raises(ValueError, match="--x"):
            _parse_range(bad, "x")


def test_workloads_lengths_and_shared_prefix() -> None:
    args = _args("--prompt-len", "10:20", "--output-len", "5:9", "--shared-prefix", "2", "--prefix-len", "16")
    work = make_workloads(args, vocab_size=5000, n=50)
    assert len(work) == 50
    assert all(26 <= len(w.token_ids) <= 36 and 5 <= w.max_new_tokens <= 9 for w in work)
    assert all(1000 <= t < 5000 for w in work for t in w.token_ids)
    prefixes = {tuple(w.token_ids[:16]) for w in work}
    assert len(prefixes) == 2
    again = make_workloads(_args("--prompt-len", "10:20", "--output-len", "5:9", "--shared-prefix", "2",
                                 "--prefix-len", "16"), vocab_size=5000, n=50)
    assert [(w.token_ids, w.max_new_tokens) for w in again] == [(w.token_ids, w.max_new_tokens) for w in work]


def test_workloads_differ_across_load_levels_but_share_prefixes() -> None:
    common = ("--prompt-len", "10", "--shared-prefix", "2", "--prefix-len", "16")
    levels = [make_workloads(_args(*common, *level), vocab_size=5000, n=20)
              for level in (("--concurrency", "1"), ("--concurrency", "32"), ("--rate", "4"))]
    bodies = [[tuple(w.token_ids[16:]) for w in work] for work in levels]
    assert len({tuple(b) for b in bodies}) == 3
    assert not set(bodies[0]) & set(bodies[1])
    prefixes = [{tuple(w.token_ids[:16]) for w in work} for work in levels]
    assert prefixes[0] == prefixes[1] == prefixes[2] and len(prefixes[0]) == 2


def test_prompts_file(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "max_new_tokens": 3}) + "\n\n" + json.dumps({"prompt": "yo"}) + "\n")
    work = make_workloads(_args("--prompts-file", str(f), "--output-len", "4"), 100, 3)
    assert [(w.text, w.max_new_tokens) for w in work] == [("hi", 3), ("yo", 4), ("hi", 3)]
    f.write_text("{not json\n")
    with pytest.raises(ValueError, match="p.jsonl:1"):
        make_workloads(_args("--prompts-file", str(f)), 100, 1)


def test_summary_figures(tmp_path) -> None:
    recs = [
        Record(0, 10, 4, start=0.0, first_token=0.1, end=0.4, output_tokens=4,
               cached_tokens=5, token_gaps=[0.1, 0.1, 0.1]),
        Record(1, 10, 4, start=0.0, first_token=0.3, end=0.6, output_tokens=4,
               cached_tokens=0, token_gaps=[0.1, 0.1, 0.1]),
        Record(2, 10, 4, start=0.0, end=0.1, status="UNAVAILABLE"),
    ]
    s = summarize(recs, wall=2.0, prefix=(100.0, 25.0))
    assert s["ok"] == 2 and s["errors"] == {"UNAVAILABLE": 1}
    assert s["output_tokens_per_s"] == pytest.approx(4.0)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["itl_p99_s"] == pytest.approx(0.1)
    assert s["prefix_hit_rate_usage"] == pytest.approx(0.25)
    assert s["prefix_hit_rate_metrics"] == pytest.approx(0.25)
    table = format_table(s)
    assert "UNAVAILABLE" in table and "25.0 %" in table and "200.0" in table
    out = tmp_path / "p.png"
    plot(recs, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("argv", "named"), [
    (["--prompt-len", "0"], "--prompt-len"),
    (["--api", "openai"], "--url"),
    (["--api", "openai", "--url", "localhost:8000"], "--url"),
    (["--url", "http://127.0.0.1:8000"], "--api openai"),
    (["--api", "http"], "--api"),
])
def test_bad_flags_exit_2(capsys, argv: list[str], named: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert named in capsys.readouterr().err


def _chunk(text: str = "", finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if usage else [{"index": 0, "text": text, "finish_reason": finish}]
    return "data: " + json.dumps({"object": "text_completion", "choices": choices, "usage": usage})


def test_parse_completion_stream() -> None:
    # vLLM's shape: one chunk per step (the one at 0.4 s holds three tokens, the one at
    # 0.3 s none that are whole text yet), then the usage chunk with no choices, then [DONE].
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}
    lines = [(0.1, _chunk("He")), (0.1, ""), (0.2, _chunk("llo")), (0.3, _chunk("")), (0.3, ": ping"),
             (0.4, _chunk(" wor")), (0.5, _chunk("ld", finish="length")), (0.5, _chunk(usage=usage)),
             (0.5, "data: [DONE]"), (0.6, "data: not json after DONE")]
    rec = Record(0, prompt_tokens=0, max_new_tokens=5)
    parse_completion_stream(rec, lines)
    assert (rec.status, rec.finish_reason) == ("OK", "length")
    assert (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == (12, 5, 8)
    assert rec.first_token == 0.1
    # 5 tokens over 4 text chunks: 1, 1, 1, 2 (the extra to the later chunks); the first
    # chunk's token has no gap, each later chunk's gap is split among its tokens.
    assert rec.token_gaps == pytest.approx([0.1, 0.2, 0.05, 0.05])

    bare = Record(1, prompt_tokens=3, max_new_tokens=5)  # no usage chunk: one token per chunk
    parse_completion_stream(bare, [(0.2, _chunk("a")), (0.5, _chunk("b"))])
    assert (bare.status, bare.output_tokens, bare.prompt_tokens, bare.cached_tokens) == ("TRUNCATED", 2, 3, 0)
    assert bare.token_gaps == pytest.approx([0.3])

    for line, status in (("data: {\"error\": {\"message\": \"boom\"}}", "STREAM_ERROR"),
                         ("data: [1, 2]", "BAD_STREAM")):
        bad = Record(2, prompt_tokens=0, max_new_tokens=1)
        parse_completion_stream(bad, [(0.1, _chunk("x")), (0.2, line), (0.3, "data: [DONE]")])
        assert bad.status == status and bad.output_tokens == 1
    refused = Record(3, prompt_tokens=0, max_new_tokens=1, status="HTTP_429")
    parse_completion_stream(refused, [])
    assert refused.status == "HTTP_429" and refused.first_token is None


def _stand_in_app():
    """An OpenAI-shaped server: two tokens per chunk, half the prompt cached, 429 for "busy"."""
    fastapi = pytest.importorskip("fastapi")
    responses = pytest.importorskip("fastapi.responses")

    # Plain request handlers (add_route): fastapi is imported here, not at module level, so
    # its parameter annotations could not be resolved.
    async def models(request):
        return responses.JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        if body["model"] == "busy":
            return responses.JSONResponse({"error": {"message": "busy"}}, status_code=429)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert request.headers.get("authorization") == "Bearer sesame"
        prompt, n = body["prompt"], body["max_tokens"]

        async def events():
            for i in range(0, n, 2):
                await asyncio.sleep(0.002)
                finish = "length" if i + 2 >= n else None
                yield _chunk("tok" * min(2, n - i), finish) + "\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}
            yield _chunk(usage=usage) + "\n\ndata: [DONE]\n\n"

        return responses.StreamingResponse(events(), media_type="text/event-stream")

    app = fastapi.FastAPI()
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    return app


@pytest.fixture(scope="module")
def stand_in_url():
    uvicorn = pytest.importorskip("uvicorn")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_stand_in_app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        threading.Event().wait(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(5)
    sock.close()


def test_openai_mode_against_stand_in(stand_in_url: str, tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    common = ["--api", "openai", "--url", stand_in_url + "/", "--auth-token", "sesame", "--quiet",
              "--num-requests", "12", "--concurrency", "4", "--prompt-len", "10:20", "--output-len", "5:8"]
    assert main([*common, "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert len(records) == 12
    for r in records:
        assert r["status"] == "OK" and r["finish_reason"] == "length"
        assert r["output_tokens"] == r["max_new_tokens"] >= 5
        assert 10 <= r["prompt_tokens"] <= 20 and r["cached_tokens"] == r["prompt_tokens"] // 2
        assert r["start"] < r["first_token"] <= r["end"]
        # Two tokens per chunk, the last maybe one: split evenly, the first chunk's get no gap.
        n = r["output_tokens"]
        assert len(r["token_gaps"]) == n - n // ((n + 1) // 2)
        assert 0 < sum(r["token_gaps"]) <= r["end"] - r["first_token"]
    assert "12/12 ok" in capsys.readouterr().out

    assert main([*common, "--model", "busy", "--json", str(out)]) == 1
    assert {r["status"] for r in json.loads(out.read_text())["records"]} == {"HTTP_429"}
    assert "HTTP_429" in capsys.readouterr().out


def test_openai_mode_unreachable(capsys) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert main(["--api", "openai", "--url", url, "--quiet", "--num-requests", "1"]) == 1
        assert "/v1/models: CONNECT_ERROR" in capsys.readouterr().err
        assert main(["--api", "openai", "--url", url, "--model", "m", "--quiet", "--num-requests", "2"]) == 1
        assert "CONNECT_ERROR" in capsys.readouterr().out
    finally:
        sock.close()
