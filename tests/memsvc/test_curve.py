"""memsvc over tcp:// only with CURVE: a real memsvc process on tcp://127.0.0.1:<free port>
answers a runner whose public key it lists, and no one else (an unknown key, no key);
it stays up. A tcp:// address without keys, and bad key files, are refused at start
(exit 2, naming the flag and the file)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.config import ConfigError
from kvserve.config.curve import client_keys, load_public_keys, load_secret_key, require_curve
from kvserve.memsvc.client import Admit, MemClient, MemsvcUnavailable, Release

from .conftest import SMALL, curve_keys, free_port, start_memsvc


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """keys/{memsvc,runner,stranger}.key[_secret]; allowed/ holds only runner.key."""
    return curve_keys(tmp_path, "runner")


def _curve_flags(root: Path) -> list[str]:
    return ["--curve-secret-key-file", str(root / "keys" / "memsvc.key_secret"),
            "--curve-public-keys-dir", str(root / "allowed")]


def _client(address: str, root: Path, name: str | None, timeout_s: float) -> MemClient:
    curve = None
    if name is not None:
        curve = client_keys(str(root / "keys" / f"{name}.key_secret"), str(root / "keys" / "memsvc.key"),
                            secret_field="curve_secret_key_file", server_field="memsvc_public_key_file")
    return MemClient(address, name=name or "anonymous", timeout_s=timeout_s, curve=curve)


@pytest.mark.timeout(120)
def test_only_listed_keys_get_an_answer(keys: Path, run_dir: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with start_memsvc(run_dir, "--address", address, *_curve_flags(keys)) as svc:
        runner = _client(address, keys, "runner", timeout_s=10)
        try:
            layout = runner.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            reply = runner.step(admit=[Admit(request_id=1, token_ids=list(range(10, 30)), max_new_tokens=4)])
            assert reply.admitted[0].ok and layout.size > 0
            runner.step(release=[Release(request_id=1, token_ids=list(range(10, 30)))])
            assert len(runner.stats().leases) == 1

            for name in ("stranger", None):  # an unknown key, and a plain client without CURVE
                intruder = _client(address, keys, name, timeout_s=1.5)
                try:
                    with pytest.raises(MemsvcUnavailable, match="did not answer"):
                        intruder.attach(n_layers=2, n_kv_heads=2, head_dim=8)
                    with pytest.raises(MemsvcUnavailable):
                        intruder.stats()
                finally:
                    intruder.close()

            assert svc.proc.poll() is None  # memsvc stays up and keeps serving the runner
            stats = runner.stats()
            assert len(stats.leases) == 1
            assert runner.step().errors == []
        finally:
            runner.close()
        assert svc.stop() == 0


def _memsvc_cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "memsvc", *SMALL, "--metrics-port", "0", *args],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, KVSERVE_RUNTIME_DIR=str(run_dir)))


@pytest.mark.timeout(120)
def test_tcp_without_keys_is_refused_at_start(keys: Path, run_dir: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    out = _memsvc_cli(run_dir, "--address", address)
    assert out.returncode == 2, out.stderr
    assert "--address: a tcp:// address needs CURVE: give --curve-secret-key-file and " \
           "--curve-public-keys-dir" in out.stderr
    out = _memsvc_cli(run_dir, "--address", address, "--curve-secret-key-file",
                      str(keys / "keys" / "memsvc.key_secret"))
    assert out.returncode == 2 and "go together" in out.stderr, out.stderr
    secret = keys / "keys" / "memsvc.key_secret"
    secret.chmod(0o640)
    out = _memsvc_cli(run_dir, "--address", address, *_curve_flags(keys))
    assert out.returncode == 2, out.stderr
    assert f"--curve-secret-key-file: secret key file {secret} has mode 0640" in out.stderr


@pytest.mark.timeout(120)
def test_ipc_needs_no_keys(run_dir: Path) -> None:
    with start_memsvc(run_dir) as svc:
        client = MemClient(svc.address, name="plain", timeout_s=10)
        try:
            assert client.stats().leases == []
        finally:
            client.close()


def _write(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_bad_key_files_are_named(keys: Path) -> None:
    k = keys / "keys"
    flag = "--curve-secret-key-file"
    cases = [
        (str(k / "nope.key_secret"), f"{flag}: secret key file {k / 'nope.key_secret'} does not exist"),
        (_write(k / "pub-as-secret", (k / "runner.key").read_text()), "holds no secret-key"),
        (_write(k / "garbage", "hello\n"), f"{flag}: {k / 'garbage'} is not a CURVE key file"),
        (_write(k / "short", 'curve\n    public-key = "abc"\n    secret-key = "def"\n'),
         "the public-key is not 40 Z85 characters"),
        (str(k), "is not a regular file"),
    ]
    for path, text in cases:
        with pytest.raises(ConfigError, match="^" + flag) as info:
            load_secret_key(path, flag)
        assert text in str(info.value), (path, str(info.value))
    # a secret whose public key was swapped for another's
    mixed = (k / "runner.key_secret").read_text().replace(
        load_secret_key(k / "runner.key_secret", flag)[0].decode(),
        load_secret_key(k / "stranger.key_secret", flag)[0].decode())
    with pytest.raises(ConfigError, match="its public-key is not the one of its secret-key"):
        load_secret_key(_write(k / "mixed", mixed), flag)


def test_bad_key_directories_are_named(keys: Path) -> None:
    flag = "--curve-public-keys-dir"
    assert len(load_public_keys(keys / "allowed", flag)) == 1
    empty = keys / "empty"
    empty.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=f"^{flag}: {empty} holds no \\*.key public key file"):
        load_public_keys(empty, flag)
    open_dir = keys / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    shutil.copy(keys / "keys" / "runner.key", open_dir / "runner.key")
    with pytest.raises(ConfigError, match=f"^{flag}: key directory {open_dir} has mode 0777"):
        load_public_keys(open_dir, flag)
    with pytest.raises(ConfigError, match="does not exist"):
        load_public_keys(keys / "missing", flag)


def test_require_curve() -> None:
    pair = (("curve_secret_key_file", "s"), ("curve_public_keys_dir", "d"))
    assert require_curve("tcp://127.0.0.1:5", "address", *pair) is True
    assert require_curve("ipc:///run/x.sock", "address", *pair) is True
    assert require_curve("ipc:///run/x.sock", "address", ("a_file", ""), ("b_dir", "")) is False
    with pytest.raises(ConfigError, match="^--address: a tcp:// address needs CURVE"):
        require_curve("tcp://127.0.0.1:5", "address", ("a_file", ""), ("b_dir", ""))
    with pytest.raises(ConfigError, match="^--a-file and --b-dir go together"):
        require_curve("ipc:///x", "address", ("a_file", ""), ("b_dir", "d"))


@pytest.mark.timeout(120)
def test_runner_refuses_tcp_memsvc_without_keys(keys: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "kvserve.cli", "runner", "--device", "cpu", "--runtime-dir", str(tmp_path / "rt"),
            "--metrics-port", "0"]
    out = subprocess.run([*base, "--memsvc-address", "tcp://127.0.0.1:1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--memsvc-address: a tcp:// address needs CURVE: give --curve-secret-key-file and " \
           "--memsvc-public-key-file" in out.stderr
    out = subprocess.run([*base, "--memsvc-address", "tcp://127.0.0.1:1", "--curve-secret-key-file",
                          str(keys / "keys" / "runner.key_secret"), "--memsvc-public-key-file",
                          str(keys / "keys" / "gone.key")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"--memsvc-public-key-file: public key file {keys / 'keys' / 'gone.key'} does not exist" in out.stderr
