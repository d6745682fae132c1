"""Fixtures that start a real `kvserve memsvc` process with a tiny pool."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ..faults.harness import stop_process

SMALL = ["--n-layers", "2", "--n-kv-heads", "2", "--head-dim", "8", "--kv-tokens", "256",
         "--max-reqs", "8", "--max-context-len", "64", "--lease-timeout-s", "1.0",
         "--integrity-interval-s", "0.3"]


def curve_keys(root: Path, client: str) -> Path:
    """keys/{memsvc,CLIENT,stranger}.key[_secret] under `root`, and allowed/ holding only
    CLIENT.key (the public keys memsvc admits); returns `root`."""
    from kvserve.tools.keygen import keygen

    keydir = root / "keys"
    for name in ("memsvc", client, "stranger"):
        keygen(keydir, name)
    allowed = root / "allowed"
    allowed.mkdir(mode=0o755)
    shutil.copy(keydir / f"{client}.key", allowed / f"{client}.key")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Memsvc:
    def __init__(self, proc: subprocess.Popen, address: str, metrics_port: int, run_dir: Path) -> None:
        self.proc, self.address, self.metrics_port, self.run_dir = proc, address, metrics_port, run_dir

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> int:
        return stop_process(self.proc)


@contextmanager
def start_memsvc(run_dir: Path, *extra: str) -> Iterator[Memsvc]:
    """Run `kvserve memsvc` until the block ends; yields once it printed 'memsvc ready'."""
    port = free_port()
    env = dict(os.environ, KVSERVE_RUNTIME_DIR=str(run_dir))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "memsvc", *SMALL, "--metrics-port", str(port), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    svc = Memsvc(proc, f"ipc://{run_dir}/memsvc.sock", port, run_dir)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "memsvc ready" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"memsvc did not start (exit {proc.poll()})")
        yield svc
    finally:
        svc.stop()
        proc.stdout.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def memsvc_factory():
    """`start_memsvc` as a fixture (test modules here are not a package)."""
    return start_memsvc
