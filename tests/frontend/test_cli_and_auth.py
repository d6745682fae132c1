"""`kvserve generate` against a real frontend, bad flag values, and bearer-token auth."""

from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

from .conftest import Frontend, start_frontend, stop_frontend

pytestmark = pytest.mark.timeout(60)
CLI = [sys.executable, "-m", "kvserve.cli"]


def test_generate_cli_streams_text(frontend: Frontend, runners) -> None:
    r = frontend.runner("r-cli")
    runners.append(r)
    assert frontend.wait_health(health_pb2.HealthCheckResponse.SERVING)
    out = subprocess.run(
        [*CLI, "generate", "hi", "--chat", "--system", "be brief", "--address", f"127.0.0.1:{frontend.port}",
         "--max-new-tokens", "7", "--temperature", "0.5", "--seed", "3", "-v"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Hello, \n"
    assert "finish_reason=length" in out.stderr and "completion_tokens=7" in out.stderr
    req = r.generate_reqs()[0]
    assert bytes(req.token_ids).decode() == "<system>be brief\n<user>hi\n<assistant>"
    assert req.params.seed == 3 and abs(req.params.temperature - 0.5) < 1e-6


def test_generate_cli_reports_server_errors(frontend: Frontend) -> None:
    out = subprocess.run([*CLI, "generate", "hi", "--address", f"127.0.0.1:{frontend.port}", "--top-p", "2"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "INVALID_ARGUMENT: sampling.top_p" in out.stderr


@pytest.mark.parametrize("argv", [
    ["serve", "--dtype", "float8"],
    ["serve", "--runners", "0"],
    ["serve", "--port", "70000"],
    ["frontend", "--max-waiting", "0"],
    ["frontend", "--port", "abc"],
    ["generate", "hi", "--max-new-tokens", "-3"],
])
def test_bad_flag_values_exit_2(argv: list[str]) -> None:
    out = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    flag = next(a for a in argv if a.startswith("--"))
    assert flag in out.stderr


def test_bearer_token_auth(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)  # the frontend refuses a token file others may read
    fe = start_frontend(tmp_path / "rt", "--auth-token-file", str(token))
    try:
        assert fe.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            list(fe.stub.Generate(pb.GenerateRequest(text="x"), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            fe.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5,
                                 metadata=[("authorization", "Bearer wrong")])
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = [("authorization", "Bearer s3cret")]
        assert fe.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5, metadata=good).name == "bytes"
        with pytest.raises(grpc.RpcError) as info:
            list(fe.stub.Generate(pb.GenerateRequest(), timeout=5, metadata=good))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        assert stop_frontend(fe) == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary to make a test certificate")
def test_tls_serves_secure_clients_only(tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    fe = start_frontend(tmp_path / "rt", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{fe.port}", creds) as channel:
            info = pb_grpc.GeneratorStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert info.name == "bytes"
        with pytest.raises(grpc.RpcError) as exc:
            fe.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)  # plaintext channel
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert stop_frontend(fe) == 0
