"""`kvserve keygen DIR [--name NAME]`: a key pair the processes accept, the secret 0600 from
the start, existing keys kept unless --force, bad names refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import zmq

from kvserve.config.curve import load_public_key, load_secret_key

CLI = [sys.executable, "-m", "kvserve.cli", "keygen"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_writes_a_pair_the_processes_accept(tmp_path: Path) -> None:
    keydir = tmp_path / "new" / "keys"
    out = subprocess.run([*CLI, str(keydir), "--name", "runner-0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    public, secret = keydir / "runner-0.key", keydir / "runner-0.key_secret"
    assert f"public key: {public}" in out.stdout and f"secret key: {secret}" in out.stdout
    assert _mode(secret) == 0o600 and _mode(public) == 0o644 and _mode(keydir) == 0o700
    pub, sec = load_secret_key(secret, "--curve-secret-key-file")
    assert load_public_key(public, "--memsvc-public-key-file") == pub
    assert zmq.curve_public(sec) == pub
    assert "secret-key" not in public.read_text()


def test_keygen_default_name_and_umask_do_not_matter(tmp_path: Path) -> None:
    out = subprocess.run(["sh", "-c", 'umask 000 && exec "$@"', "sh", *CLI, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _mode(tmp_path / "kvserve.key_secret") == 0o600
    assert _mode(tmp_path / "kvserve.key") == 0o644


def test_keygen_keeps_existing_keys_unless_forced(tmp_path: Path) -> None:
    assert subprocess.run([*CLI, str(tmp_path), "--name", "a"], capture_output=True, timeout=60).returncode == 0
    before = (tmp_path / "a.key_secret").read_text()
    out = subprocess.run([*CLI, str(tmp_path), "--name", "a"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "already exist" in out.stderr and str(tmp_path / "a.key") in out.stderr
    assert (tmp_path / "a.key_secret").read_text() == before
    (tmp_path / "a.key_secret").chmod(0o644)  # --force must not keep a loose old mode
    out = subprocess.run([*CLI, str(tmp_path), "--name", "a", "--force"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "a.key_secret").read_text() != before
    assert _mode(tmp_path / "a.key_secret") == 0o600


def test_keygen_refuses_bad_names(tmp_path: Path) -> None:
    for name in ("../x", "", ".."):
        out = subprocess.run([*CLI, str(tmp_path), "--name", name], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "--name" in out.stderr, (name, out.stderr)
    assert os.listdir(tmp_path) == []


def test_cli_lists_keygen() -> None:
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert "keygen" in out.stdout
