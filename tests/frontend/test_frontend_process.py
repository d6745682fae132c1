"""A real `kvserve frontend` process against fake runners in the test process."""

from __future__ import annotations

import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvserve.v1 import generator_pb2 as pb

from .conftest import Frontend, start_frontend, stop_frontend

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REPLY = "Hello, wörld! 你好 and more text to fill the stream."


def _prefix(n: int) -> str:
    """What n reply tokens (bytes) decode to; a cut character ends as U+FFFD."""
    return REPLY.encode()[:n].decode("utf-8", errors="replace")

pytestmark = pytest.mark.timeout(60)


def _collect(stream) -> tuple[list[pb.GenerateResponse], str]:
    msgs = list(stream)
    return msgs, "".join(m.text for m in msgs)


def test_no_runner_means_not_serving_and_unavailable(frontend: Frontend, runners) -> None:
    assert frontend.wait_health(NOT_SERVING)
    with pytest.raises(grpc.RpcError) as info:
        list(frontend.stub.Generate(pb.GenerateRequest(text="hi"), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stream_text_usage_and_health(frontend: Frontend, runners) -> None:
    # the runner's cached_tokens differs per request: usage must carry the runner's own number
    runners.append(frontend.runner("r-a", cached_of=lambda req: len(req.token_ids) - 1))
    assert frontend.wait_health(SERVING)
    msgs, text = _collect(frontend.stub.Generate(pb.GenerateRequest(text="abcdefg"), timeout=10))
    assert text == REPLY
    assert len(msgs) > 10 and all("\ufffd" not in m.text for m in msgs)
    last = msgs[-1]
    assert last.finish_reason == "stop"
    n_tokens = len(REPLY.encode()) + 1  # + EOS
    assert sum(len(m.token_ids) for m in msgs) == n_tokens
    assert (last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.completion_tokens) == (7, 6, n_tokens)
    assert all(not m.finish_reason for m in msgs[:-1])
    req = runners[0].generate_reqs()[0]
    assert req.token_ids == list(b"abcdefg") and req.params.temperature == 0.0
    short = pb.GenerateRequest(text="x" * 12, sampling=pb.SamplingParams(max_new_tokens=2))
    usage = _collect(frontend.stub.Generate(short, timeout=10))[0][-1].usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (12, 11, 2)


def test_max_new_tokens_gives_length(frontend: Frontend, runners) -> None:
    runners.append(frontend.runner("r-b"))
    assert frontend.wait_health(SERVING)
    req = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_new_tokens=5))
    msgs, text = _collect(frontend.stub.Generate(req, timeout=10))
    assert text == _prefix(5) and msgs[-1].finish_reason == "length"
    assert msgs[-1].usage.completion_tokens == 5


def test_stop_string_across_tokens_aborts_runner(frontend: Frontend, runners) -> None:
    r = frontend.runner("r-c")
    runners.append(r)
    assert frontend.wait_health(SERVING)
    req = pb.GenerateRequest(text="x", request_id="stop-1", sampling=pb.SamplingParams(stop=["wörld"]))
    msgs, text = _collect(frontend.stub.Generate(req, timeout=10))
    assert text == "Hello, " and msgs[-1].finish_reason == "stop"
    wire = r.generate_reqs()[-1].request_id  # the frontend's id of this attempt, not the client's
    assert wire != "stop-1" and r.wait_for(lambda: set(r.aborts()) == {wire})


def test_client_cancel_and_deadline_abort_in_runner(frontend: Frontend, runners) -> None:
    r = frontend.runner("r-d", step_s=0.2)
    runners.append(r)
    assert frontend.wait_health(SERVING)
    call = frontend.stub.Generate(pb.GenerateRequest(text="x", request_id="cancel-1"), timeout=30)
    next(call)
    call.cancel()
    cancelled = r.generate_reqs()[-1].request_id
    assert r.wait_for(lambda: set(r.aborts()) == {cancelled}, timeout=2)
    with pytest.raises(grpc.RpcError) as info:
        list(frontend.stub.Generate(pb.GenerateRequest(text="x", request_id="dl-1"), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    late = r.generate_reqs()[-1].request_id
    assert late != cancelled and r.wait_for(lambda: set(r.aborts()) == {cancelled, late}, timeout=2)


def test_abort_rpc_ends_stream_with_abort(frontend: Frontend, runners) -> None:
    r = frontend.runner("r-e", step_s=0.1)
    runners.append(r)
    assert frontend.wait_health(SERVING)
    call = frontend.stub.Generate(pb.GenerateRequest(text="x", request_id="ab-1"), timeout=30)
    first = next(call)
    assert first.request_id == "ab-1"
    assert frontend.stub.Abort(pb.AbortRequest(request_id="ab-1"), timeout=5).aborted
    rest = list(call)
    assert rest[-1].finish_reason == "abort"
    assert r.wait_for(lambda: set(r.aborts()) == {r.generate_reqs()[-1].request_id})
    assert not frontend.stub.Abort(pb.AbortRequest(request_id="nope"), timeout=5).aborted


def test_least_loaded_routing_spreads_requests(frontend: Frontend, runners) -> None:
    a, b = frontend.runner("r-f1", step_s=0.05), frontend.runner("r-f2", step_s=0.05)
    runners += [a, b]
    assert a.wait_for(lambda: len(frontend.stub.GetLoad(pb.GetLoadRequest(), timeout=5).runners) == 2)
    calls = [frontend.stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_new_tokens=20)),
                                    timeout=20) for _ in range(4)]
    results = [_collect(c)[1] for c in calls]
    assert results == [_prefix(20)] * 4
    assert len(a.generate_reqs()) == 2 and len(b.generate_reqs()) == 2


def test_runner_death_unavailable_and_retry_of_unstarted(frontend: Frontend, runners) -> None:
    r = frontend.runner("r-g", step_s=0.1)
    runners.append(r)
    assert frontend.wait_health(SERVING)
    call = frontend.stub.Generate(pb.GenerateRequest(text="x"), timeout=20)
    next(call)
    r.kill()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert frontend.wait_health(NOT_SERVING, timeout=2)
    # A request that streamed nothing yet moves to another live runner.
    stuck = frontend.runner("r-h", hold=True)
    runners.append(stuck)
    assert frontend.wait_health(SERVING)
    call = frontend.stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_new_tokens=3)),
                                  timeout=20)
    assert stuck.wait_for(lambda: len(stuck.generate_reqs()) == 1)
    good = frontend.runner("r-i")
    runners.append(good)
    assert good.wait_for(lambda: len(frontend.stub.GetLoad(pb.GetLoadRequest(), timeout=5).runners) == 2)
    stuck.kill()
    assert _collect(call)[1] == _prefix(3)
    assert len(good.generate_reqs()) == 1


def test_waiting_queue_full_is_resource_exhausted(frontend: Frontend, runners) -> None:
    r = frontend.runner("r-j", hold=True)
    runners.append(r)
    assert frontend.wait_health(SERVING)
    calls = [frontend.stub.Generate(pb.GenerateRequest(text="x"), timeout=20) for _ in range(4)]
    assert r.wait_for(lambda: len(r.generate_reqs()) == 4)
    with pytest.raises(grpc.RpcError) as info:
        list(frontend.stub.Generate(pb.GenerateRequest(text="x"), timeout=5))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for c in calls:
        c.cancel()
    assert r.wait_for(lambda: len(r.aborts()) == 4)


BAD = [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[300])), "prompt.token_ids[0]"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_new_tokens=0)), "sampling.max_new_tokens"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_new_tokens=501)), "sampling.max_new_tokens"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_k=-2)), "sampling.top_k"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(min_p=2)), "sampling.min_p"),
    (pb.GenerateRequest(text="x" * 5000), "prompt"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")])),
     "prompt.chat.messages[0].role"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["s"] * 17)), "sampling.stop"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["s" * 300])), "sampling.stop[0]"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop_token_ids=[1] * 257)), "sampling.stop_token_ids"),
    (pb.GenerateRequest(text="x" * (1024 * 1024 + 1)), "prompt.text"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")] * 1025)),
     "prompt.chat.messages"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x" * 600_000)] * 2)),
     "prompt.chat"),
]


@pytest.mark.parametrize(("request_", "field"), BAD, ids=[f for _, f in BAD])
def test_invalid_argument_names_field(frontend: Frontend, request_: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(frontend.stub.Generate(request_, timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ")


def test_model_info_and_tokenize(frontend: Frontend) -> None:
    info = frontend.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (info.name, info.vocab_size, info.max_new_tokens_cap) == ("bytes", 257, 500)
    ids = frontend.stub.Tokenize(pb.TokenizeRequest(text="hé"), timeout=5).token_ids
    assert list(ids) == list("hé".encode())
    with pytest.raises(grpc.RpcError) as info:
        frontend.stub.Tokenize(pb.TokenizeRequest(text="x" * (1024 * 1024 + 1)), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == ("input.text: 1048577 characters is longer than the limit of 1048576 "
                                    "(max_prompt_chars)")


def test_sigterm_drains_open_stream_and_exits_0(tmp_path) -> None:
    fe = start_frontend(tmp_path / "rt", "--drain-timeout-s", "10")
    r = fe.runner("r-drain", step_s=0.02)
    try:
        assert fe.wait_health(SERVING)
        call = fe.stub.Generate(pb.GenerateRequest(text="x"), timeout=20)
        first = next(call)
        fe.proc.send_signal(signal.SIGTERM)
        assert fe.wait_health(NOT_SERVING, timeout=2)
        rest = list(call)
        assert first.text + "".join(m.text for m in rest) == REPLY
        assert rest[-1].finish_reason == "stop"
        assert fe.proc.wait(timeout=10) == 0
    finally:
        r.kill()
        stop_frontend(fe)
    assert list((tmp_path / "rt").iterdir()) == []


def test_sd_notify_ready_only_with_a_live_runner(tmp_path) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(0.5)

        def messages() -> list[bytes]:
            out = []
            while True:
                try:
                    out.append(sock.recv(4096))
                except TimeoutError:
                    return out

        fe = start_frontend(tmp_path / "rt", notify_socket=str(path))
        r = None
        try:
            assert fe.health_status() == NOT_SERVING  # the port answers ...
            assert b"READY=1" not in messages()  # ... but no runner yet
            r = fe.runner("r-notify")
            assert fe.wait_health(SERVING)
            assert b"READY=1" in messages()
            fe.proc.send_signal(signal.SIGTERM)
            assert fe.proc.wait(timeout=10) == 0
            assert b"STOPPING=1" in messages()
        finally:
            if r is not None:
                r.kill()
            stop_frontend(fe)


def test_oversized_request_message_is_rejected(frontend: Frontend) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(frontend.stub.Generate(pb.GenerateRequest(text="x" * (5 * 1024 * 1024)), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
