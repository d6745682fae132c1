"""What a runner's output turns into at the client (issue 15): the logprobs mapping
(`TokenOut.logprobs` -> the proto's TokenLogprob / TopLogprob, ids paired with their own
values), the status of a request the runner failed (`TokenOut.error_code`), and tiny
temperatures, which the frontend takes and the runner samples greedily."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.grpc_service import _logprobs
from kvserve.frontend.validation import prepare
from kvserve.messages.frontend_runner import GREEDY_TEMPERATURE, TokenLogprob, TokenOut
from kvserve.model.tokenizer import ByteTokenizer
from kvserve.v1 import generator_pb2 as pb

from .conftest import Frontend
from .fake_runner import fake_logprob

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
REPLY = "Hello, wörld! 你好 and more text to fill the stream."


def _pairs(lp: pb.TokenLogprob) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for t in lp.top]


def test_logprobs_mapping_pairs_each_id_with_its_own_value() -> None:
    out = TokenOut(request_id="r", token_ids=[5, 9], logprobs=[
        TokenLogprob(logprob=-0.5, top_ids=[5, 3], top_logprobs=[-0.5, -1.25]),
        TokenLogprob(logprob=-2.0, top_ids=[1, 9, 4], top_logprobs=[-0.75, -2.0, -3.5]),
    ])
    got = _logprobs(out.token_ids, out.logprobs)
    assert [(m.token_id, m.logprob) for m in got] == [(5, -0.5), (9, -2.0)]
    assert _pairs(got[0]) == [(5, -0.5), (3, -1.25)]
    assert _pairs(got[1]) == [(1, -0.75), (9, -2.0), (4, -3.5)]
    assert _logprobs([5], []) == []


def test_logprobs_through_a_frontend_process(frontend: Frontend, runners) -> None:
    runners.append(frontend.runner("r-lp", with_logprobs=True))
    assert frontend.wait_health(SERVING)
    req = pb.GenerateRequest(text="abc", sampling=pb.SamplingParams(max_new_tokens=12, logprobs=3))
    msgs = list(frontend.stub.Generate(req, timeout=10))
    ids = [t for m in msgs for t in m.token_ids]
    assert bytes(ids).decode() == REPLY.encode()[:12].decode()
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == len(ids) == 12
    for tok, lp in zip(ids, lps, strict=True):
        want = fake_logprob(tok, 3)
        assert lp.token_id == tok and lp.logprob == want.logprob
        assert _pairs(lp) == list(zip(want.top_ids, want.top_logprobs, strict=True))
    plain = list(frontend.stub.Generate(pb.GenerateRequest(text="abc", sampling=pb.SamplingParams(
        max_new_tokens=4)), timeout=10))
    assert [lp for m in plain for lp in m.logprobs] == []


@pytest.mark.parametrize(("code", "status"), [
    ("INTERNAL", grpc.StatusCode.INTERNAL),
    ("INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT),
    ("", grpc.StatusCode.UNAVAILABLE),
    ("BOGUS", grpc.StatusCode.UNAVAILABLE),
])
def test_runner_error_code_is_the_call_status(frontend: Frontend, runners, code: str,
                                              status: grpc.StatusCode) -> None:
    runners.append(frontend.runner(f"r-fail-{code or 'none'}", fail_with=("logits were NaN here", code)))
    assert frontend.wait_health(SERVING)
    with pytest.raises(grpc.RpcError) as info:
        list(frontend.stub.Generate(pb.GenerateRequest(text="abc"), timeout=10))
    assert info.value.code() == status
    assert "logits were NaN here" in info.value.details()


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, GREEDY_TEMPERATURE / 2, 0.0])
def test_tiny_temperatures_are_taken_as_sent(temperature: float) -> None:
    cfg = FrontendConfig(tokenizer="bytes")
    req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=temperature))
    got = prepare(req, ByteTokenizer(), cfg, context_len=64).params.temperature
    assert got == pytest.approx(temperature, rel=1e-4)  # float32 on the wire (1e-40 is subnormal)
    assert got < GREEDY_TEMPERATURE
