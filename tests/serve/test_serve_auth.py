"""`kvserve serve --auth-token-file`: the service becomes ready (the runners' READY reaches
serve over sd_notify, whatever the frontend asks of clients); clients without the token are
refused, clients with it are served."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvserve.v1 import generator_pb2 as pb
from tests.faults.harness import start_serve, stop_serve
from tests.model.tinymodel import write_tiny_model

pytestmark = pytest.mark.timeout(180)


def test_serve_with_a_bearer_token_becomes_ready(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    svc = start_serve(tmp_path / "rt", model, "--auth-token-file", str(token), ready_s=60.0)
    try:
        req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_new_tokens=3, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as info:
            list(svc.stub.Generate(req, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        msgs = list(svc.stub.Generate(req, timeout=30, metadata=(("authorization", "Bearer s3cret-token"),)))
        assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 3
    finally:
        assert stop_serve(svc) == 0
