"""Who gets in at the frontend, with real processes: the bearer token file only its owner
may read (else exit 2 naming it and its mode), mutual TLS with certificates made here by
the openssl CLI (no certificate or one another CA signed: refused; one our CA signed:
served), and CURVE on a tcp:// runner link (only listed runner keys register)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import zmq
from grpc_health.v1 import health_pb2

from kvserve.config.curve import apply_client, client_keys
from kvserve.messages.frontend_runner import UP, Hello
from kvserve.tools.keygen import keygen
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

from ..memsvc.conftest import free_port
from .conftest import start_frontend, stop_frontend

FRONTEND = [sys.executable, "-m", "kvserve.cli", "frontend", "--tokenizer", "bytes", "--port", "0",
            "--metrics-port", "0"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _refused(tmp_path: Path, *args: str) -> str:
    """Run the frontend with `args`; it must exit 2 at once. Returns its stderr."""
    out = subprocess.run([*FRONTEND, "--runtime-dir", str(tmp_path / "rt"), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stderr)
    return out.stderr


# ---- bearer token file ------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_token_file_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(mode)
    err = _refused(tmp_path, "--auth-token-file", str(token))
    assert f"--auth-token-file: {token} has mode {mode:04o}" in err and "chmod 600" in err


@pytest.mark.timeout(120)
def test_missing_or_empty_token_file_is_refused(tmp_path: Path) -> None:
    err = _refused(tmp_path, "--auth-token-file", str(tmp_path / "absent"))
    assert f"--auth-token-file: cannot read {tmp_path / 'absent'}" in err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    assert f"--auth-token-file: {empty} is empty" in _refused(tmp_path, "--auth-token-file", str(empty))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_owner_only_token_file_is_used(tmp_path: Path, mode: int) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(mode)
    fe = start_frontend(tmp_path / "rt", "--auth-token-file", str(token))
    try:
        with pytest.raises(grpc.RpcError) as info:
            fe.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = [("authorization", "Bearer s3cret")]
        assert fe.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5, metadata=good).name == "bytes"
    finally:
        assert stop_frontend(fe) == 0


# ---- mutual TLS -------------------------------------------------------------------------

def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-days", "1", "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(key), "-out", str(cert))
    return key, cert


def _signed(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    key, csr, cert, extfile = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    extfile.write_text(ext + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
             f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]), "-CAcreateserial",
             "-days", "1", "-extfile", str(extfile), "-out", str(cert))
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl binary to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = _ca(d, "ca"), _ca(d, "rogue-ca")
    return {
        "ca": ca,
        "server": _signed(d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                          "extendedKeyUsage=serverAuth"),
        "client": _signed(d, "client", ca, "extendedKeyUsage=clientAuth"),
        "rogue": _signed(d, "rogue-client", rogue, "extendedKeyUsage=clientAuth"),
    }


def _model_info(port: int, ca: Path, client: tuple[Path, Path] | None) -> str:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client[0].read_bytes() if client else None,
        certificate_chain=client[1].read_bytes() if client else None)
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        return pb_grpc.GeneratorStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5).name


@pytest.mark.timeout(120)
def test_mutual_tls_admits_only_certificates_our_ca_signed(tmp_path: Path, pki) -> None:
    key, cert = pki["server"]
    fe = start_frontend(tmp_path / "rt", "--tls-cert", str(cert), "--tls-key", str(key),
                        "--tls-client-ca", str(pki["ca"][1]), http=True)
    try:
        assert _model_info(fe.port, pki["ca"][1], pki["client"]) == "bytes"
        # the HTTP face takes the same certificates
        https = f"https://127.0.0.1:{fe.http_port}/v1/models"
        ours = ssl.create_default_context(cafile=pki["ca"][1])
        ours.load_cert_chain(pki["client"][1], pki["client"][0])
        assert httpx.get(https, verify=ours).json()["data"][0]["id"] == "bytes"
        for client in (None, pki["rogue"]):
            ctx = ssl.create_default_context(cafile=pki["ca"][1])
            if client:
                ctx.load_cert_chain(client[1], client[0])
            with pytest.raises(httpx.TransportError):
                httpx.get(https, verify=ctx)
        with pytest.raises(httpx.TransportError):  # plaintext
            httpx.get(f"http://127.0.0.1:{fe.http_port}/v1/models")
        for client in (None, pki["rogue"]):
            with pytest.raises(grpc.RpcError) as info:
                _model_info(fe.port, pki["ca"][1], client)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, client
        with pytest.raises(grpc.RpcError) as info:  # plaintext
            fe.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert fe.proc.poll() is None
        assert _model_info(fe.port, pki["ca"][1], pki["client"]) == "bytes"
    finally:
        assert stop_frontend(fe) == 0


@pytest.mark.timeout(120)
def test_tls_without_client_ca_still_serves_clients_without_certificates(tmp_path: Path, pki) -> None:
    key, cert = pki["server"]
    fe = start_frontend(tmp_path / "rt", "--tls-cert", str(cert), "--tls-key", str(key), http=True)
    try:
        assert _model_info(fe.port, pki["ca"][1], None) == "bytes"
        ctx = ssl.create_default_context(cafile=pki["ca"][1])
        assert httpx.get(f"https://127.0.0.1:{fe.http_port}/version", verify=ctx).status_code == 200
    finally:
        assert stop_frontend(fe) == 0


@pytest.mark.timeout(120)
def test_bad_tls_settings_exit_2(tmp_path: Path, pki) -> None:
    key, cert = pki["server"]
    err = _refused(tmp_path, "--tls-client-ca", str(pki["ca"][1]))
    assert "--tls-client-ca needs --tls-cert" in err
    absent = tmp_path / "absent-ca.pem"
    err = _refused(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(absent))
    assert f"--tls-client-ca: cannot read {absent}" in err
    notpem = tmp_path / "ca.txt"
    notpem.write_text("not a certificate\n")
    err = _refused(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(notpem))
    assert f"--tls-client-ca: {notpem} is not a PEM file" in err


# ---- CURVE on a tcp:// runner link ------------------------------------------------------

def _hello_until(fe, address: str, keys, want: int, runner_id: str, seconds: float) -> bool:
    """Say Hello as `runner_id` (CURVE with `keys`, or plain) until health is `want`."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.IDENTITY, runner_id.encode())
    if keys is not None:
        apply_client(sock, keys)
    sock.connect(address)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:  # a refused peer never completes its handshake: nothing to send to
                sock.send(UP.encode(Hello(runner_id=runner_id, pid=os.getpid(), max_context_len=4096)),
                          zmq.NOBLOCK)
            except zmq.Again:
                pass
            if fe.health_status() == want:
                return True
            time.sleep(0.1)
        return False
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(120)
def test_tcp_runner_link_admits_only_listed_runner_keys(tmp_path: Path) -> None:
    keydir, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("frontend", "runner", "stranger"):
        keygen(keydir, name)
    allowed.mkdir(mode=0o700)
    shutil.copy(keydir / "runner.key", allowed / "runner.key")
    address = f"tcp://127.0.0.1:{free_port()}"

    err = _refused(tmp_path, "--frontend-address", address)
    assert "--frontend-address: a tcp:// address needs CURVE: give --curve-secret-key-file and " \
           "--curve-public-keys-dir" in err

    def keys(name: str):
        return client_keys(str(keydir / f"{name}.key_secret"), str(keydir / "frontend.key"),
                           secret_field="curve_secret_key_file", server_field="frontend_public_key_file")

    fe = start_frontend(tmp_path / "rt", "--frontend-address", address, "--curve-secret-key-file",
                        str(keydir / "frontend.key_secret"), "--curve-public-keys-dir", str(allowed))
    try:
        assert fe.zmq_address == address
        assert not _hello_until(fe, address, keys("stranger"), SERVING, "stranger", 1.5)
        assert not _hello_until(fe, address, None, SERVING, "plain", 1.5)
        assert fe.proc.poll() is None
        assert _hello_until(fe, address, keys("runner"), SERVING, "runner-0", 10.0)
    finally:
        assert stop_frontend(fe) == 0
