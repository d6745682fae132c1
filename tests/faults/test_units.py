"""Fast checks of the security and limit rules (no model, no serve): no pickle on any socket,
loopback-only defaults and addresses, and a memsvc context never longer than its pool."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvserve
from kvserve.config import ConfigError
from kvserve.config.frontend import FrontendConfig
from kvserve.config.memsvc import MemsvcConfig
from kvserve.config.serve import ServeConfig, load_serve_config
from kvserve.memsvc.shape import resolve_shape
from kvserve.serve.main import Supervisor

PACKAGE = Path(kvserve.__file__).parent


def test_no_pickle_anywhere_in_the_package() -> None:
    """No module imports a pickle-like serializer or calls pyzmq's pickle helpers (code only:
    docstrings may say "no pickle")."""
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "recv_pyobj",
              "send_pyobj", "loads_pickle", "ForkingPickler"}
    hits = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0], *(a.name for a in node.names)]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            hits += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {n}" for n in names if n in banned]
    assert not hits, hits


def test_grpc_and_metrics_bind_loopback_by_default() -> None:
    assert FrontendConfig().host == "127.0.0.1" and ServeConfig().frontend.host == "127.0.0.1"
    assert MemsvcConfig().metrics_host == "127.0.0.1" and not MemsvcConfig().allow_remote


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://example.com:1"])
def test_non_loopback_tcp_needs_allow_remote(address: str) -> None:
    with pytest.raises(ConfigError, match="--address: .* not a loopback address .*--allow-remote"):
        MemsvcConfig(address=address)
    MemsvcConfig(address=address, allow_remote=True)
    with pytest.raises(ConfigError, match="--frontend-address: .* not a loopback address .*--allow-remote"):
        FrontendConfig(frontend_address=address)
    FrontendConfig(frontend_address=address, allow_remote=True)
    FrontendConfig(frontend_address="tcp://127.0.0.1:5555")
    FrontendConfig(frontend_address="tcp://[::1]:5555")


def test_memsvc_cli_refuses_remote_tcp_with_exit_2(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "memsvc", "--address", "tcp://0.0.0.0:5999",
                        "--runtime-dir", str(tmp_path / "rt")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a loopback address" in r.stderr, r.stderr


def test_memsvc_context_never_exceeds_the_pool() -> None:
    small = dict(n_layers=2, n_kv_heads=2, head_dim=8)
    assert resolve_shape(MemsvcConfig(**small, kv_tokens=100, max_context_len=512)).max_context_len == 100
    assert resolve_shape(MemsvcConfig(**small, kv_tokens=1000, max_context_len=512)).max_context_len == 512
    shape = resolve_shape(MemsvcConfig(**small, kv_tokens=100, page_size=16))
    assert shape.max_context_len == 96 and shape.size == 96 + 16


@pytest.mark.parametrize("flag", ["max_message_bytes", "max_new_tokens_cap", "max_concurrent_streams"])
def test_serve_limits_are_checked(flag: str) -> None:
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}: must be > 0"):
        load_serve_config(env={}, flags={flag: 0})
    with pytest.raises(ConfigError, match="--max-prompt-tokens: must be >= 0"):
        load_serve_config(env={}, flags={"max_prompt_tokens": -1})


def test_serve_passes_limits_tls_and_auth_to_the_frontend(tmp_path: Path) -> None:
    cfg = load_serve_config(env={}, flags=dict(
        device="cpu", max_message_bytes=1000, max_prompt_tokens=7, max_new_tokens_cap=9,
        max_concurrent_streams=3, tls_cert="/c.pem", tls_key="/k.pem", auth_token_file="/t", host="::1"))
    argv = Supervisor(cfg, tmp_path).by_role("frontend")[0].argv
    flags = dict(arg.split("=", 1) for arg in argv[4:])
    for flag, value in {"--max-message-bytes": "1000", "--max-prompt-tokens": "7", "--max-new-tokens-cap": "9",
                        "--max-concurrent-streams": "3", "--tls-cert": "/c.pem", "--tls-key": "/k.pem",
                        "--auth-token-file": "/t", "--host": "::1"}.items():
        assert flags.get(flag) == value, (flag, argv)
    plain = Supervisor(ServeConfig(), tmp_path).by_role("frontend")[0].argv
    assert not any(a.startswith(("--tls-cert", "--auth-token-file")) for a in plain), plain
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key must be given together"):
        load_serve_config(env={}, flags={"tls_cert": "/c.pem"})


def test_serve_shares_the_cores_among_several_runners(tmp_path: Path) -> None:
    """Each of N runners with torch's default thread count would take every core (and OpenMP
    spins): serve gives each its share, unless --threads says otherwise."""
    import os

    cores = os.cpu_count() or 1
    two = Supervisor(load_serve_config(env={}, flags={"runners": 2}), tmp_path).by_role("runner")
    assert all(f"--threads={max(1, cores // 2)}" in c.argv for c in two), [c.argv for c in two]
    one = Supervisor(ServeConfig(), tmp_path).by_role("runner")[0].argv
    assert not any(a.startswith("--threads") for a in one), one
    from kvserve.config.runner import RunnerConfig

    mine = Supervisor(ServeConfig(runners=2, runner=RunnerConfig(threads=3)), tmp_path).by_role("runner")
    assert all("--threads=3" in c.argv for c in mine)
