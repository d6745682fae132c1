"""The frontend's gRPC server as a client meets it: reflection, the server-wide limits
(concurrent calls, response size, keepalive pings) and an event loop that a long
tokenization does not stall. A real `kvserve frontend` process against fake runners."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvserve.model.tokenizer import ByteTokenizer
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

from .conftest import Frontend, start_frontend, stop_frontend

pytestmark = pytest.mark.timeout(90)
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_services(frontend: Frontend) -> None:
    db = ProtoReflectionDescriptorDatabase(frontend.channel)
    assert sorted(db.get_services()) == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                         "kvserve.v1.Generator"]
    pool = descriptor_pool.DescriptorPool(db)
    service = pool.FindServiceByName("kvserve.v1.Generator")
    assert [m.name for m in service.methods] == ["Generate", "GetModelInfo", "Tokenize", "Abort", "GetLoad"]
    generate = service.methods_by_name["Generate"]
    assert (generate.input_type.full_name, generate.output_type.full_name) == (
        "kvserve.v1.GenerateRequest", "kvserve.v1.GenerateResponse")
    assert generate.server_streaming and not generate.client_streaming
    # enough for a client without our stubs to build a request
    sampling = pool.FindMessageTypeByName("kvserve.v1.SamplingParams")
    assert sampling.fields_by_name["stop_token_ids"].number == 11


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_more_concurrent_calls_than_allowed_and_too_long_a_response_are_resource_exhausted(tmp_path) -> None:
    fe = start_frontend(tmp_path / "rt", "--max-concurrent-rpcs", "3", "--max-send-message-bytes", "1000")
    r = fe.runner("r-hold", hold=True)
    try:
        assert fe.wait_health(SERVING)
        calls = [fe.stub.Generate(pb.GenerateRequest(text="x"), timeout=30) for _ in range(3)]
        assert r.wait_for(lambda: len(r.generate_reqs()) == 3)
        info = pb.GetModelInfoRequest()
        assert _code(lambda: list(fe.stub.Generate(pb.GenerateRequest(text="x"), timeout=5))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _code(lambda: fe.stub.GetModelInfo(info, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(r.generate_reqs()) == 3
        calls[0].cancel()
        assert r.wait_for(lambda: _code(lambda: fe.stub.GetModelInfo(info, timeout=5)) == grpc.StatusCode.OK)
        for c in calls[1:]:
            c.cancel()
        assert r.wait_for(lambda: len(r.aborts()) == 3)
        # 900 one-byte ids fit a 1000-byte response, 1000 do not
        assert len(fe.stub.Tokenize(pb.TokenizeRequest(text="x" * 900), timeout=5).token_ids) == 900
        with pytest.raises(grpc.RpcError) as exc:
            fe.stub.Tokenize(pb.TokenizeRequest(text="x" * 1000), timeout=5)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert exc.value.details() == ("input: its 1000 token ids take 1003 bytes, more than the largest "
                                       "response of 1000 (max_send_message_bytes)")
    finally:
        r.kill()
        assert stop_frontend(fe) == 0


def test_a_client_that_pings_too_often_is_sent_away(frontend: Frontend, runners) -> None:
    """The server allows a keepalive ping every 10 s; one every 100 ms on an idle stream earns
    a GOAWAY (too_many_pings) after two strikes, which ends the stream UNAVAILABLE."""
    r = frontend.runner("r-pinged", hold=True)
    runners.append(r)
    assert frontend.wait_health(SERVING)
    pushy = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_timeout_ms", 5000),
             ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    with grpc.insecure_channel(f"127.0.0.1:{frontend.port}", options=pushy) as channel:
        call = pb_grpc.GeneratorStub(channel).Generate(pb.GenerateRequest(text="x"), timeout=20)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            list(call)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
    assert time.monotonic() - start < 10
    assert r.wait_for(lambda: len(r.aborts()) == 1)


HUGE_CHARS = 4 * 1024 * 1024  # the byte tokenizer takes seconds on it (0.7 s per MiB on a quiet machine)
MAX_GAP_S = 0.25  # the steady stream steps every 10 ms


def test_a_huge_prompt_being_tokenized_does_not_stall_other_streams(tmp_path) -> None:
    text = "x" * HUGE_CHARS
    t0 = time.perf_counter()
    ByteTokenizer().encode(text)
    tokenize_s = time.perf_counter() - t0
    # on the event loop this tokenization would stop every stream for tokenize_s
    assert tokenize_s > 3 * MAX_GAP_S, f"the prompt tokenizes in {tokenize_s:.2f} s: too fast to show a stall"
    fe = start_frontend(tmp_path / "rt", "--max-prompt-chars", str(HUGE_CHARS),
                        "--max-message-bytes", str(2 * HUGE_CHARS))
    r = fe.runner("r-steady", step_s=0.01, reply="a" * 4000)
    arrivals: list[float] = []
    try:
        assert fe.wait_health(SERVING)
        call = fe.stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_new_tokens=4000)),
                                timeout=60)

        def consume() -> None:
            try:
                for _ in call:
                    arrivals.append(time.monotonic())
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        assert r.wait_for(lambda: len(arrivals) >= 20)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            list(fe.stub.Generate(pb.GenerateRequest(text=text), timeout=60))
        end = time.monotonic()
        # it was tokenized (only then is its length in tokens known) and refused
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details().startswith(f"prompt: {HUGE_CHARS} tokens is longer than the limit")
        time.sleep(0.1)
        call.cancel()
        reader.join(5)
    finally:
        r.kill()
        assert stop_frontend(fe) == 0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > start and a < end]
    print(f"\ntokenize {tokenize_s:.2f} s here, the huge call took {end - start:.2f} s; "
          f"{len(gaps)} gaps meanwhile, the largest {max(gaps, default=0):.3f} s")
    assert max(gaps, default=end - start) < MAX_GAP_S, "the steady stream stalled while the prompt was tokenized"
    assert len(gaps) >= (end - start) / 0.05, "the steady stream hardly streamed during the huge call"
