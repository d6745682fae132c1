"""The tokenizer.json cache for GGUF files: where it lives, and building it in a child process.

A GGUF file carries its vocabulary and merges but no tokenizer.json. transformers can turn
the metadata into one (slowly, and importing transformers costs hundreds of MB), so it is
done once per file and cached as a tokenizer directory under
``kvserve.paths.cache_dir()/tokenizers``, keyed by the file's path, size and mtime.

`ensure_cached(path)` is what the torch-free frontend calls: it returns the cached directory,
building it first in a child process (``python -m kvserve.model.tokenizer_cache FILE``) so
that the caller never imports transformers. `build(path)` is the builder itself, run by that
child or in-process by model-side code that has transformers loaded already. Directories
are written whole and renamed into place, so a reader never sees a half-written one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.model.files import ModelFileError, file_key
from kvserve.paths import cache_dir

BUILD_TIMEOUT_S = 600.0


def cache_target(path: Path, cache_root: Path | None = None) -> Path:
    """The cache directory for the tokenizer of the GGUF file at `path`."""
    root = cache_root if cache_root is not None else cache_dir() / "tokenizers"
    return root / file_key(path)


def build(path: Path, cache_root: Path | None = None) -> Path:
    """Build (unless cached) the tokenizer directory of `path` with transformers; return it."""
    target = cache_target(path, cache_root)
    if (target / "tokenizer.json").is_file():
        return target
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise ModelFileError(f"model {path}: cannot build a tokenizer from the GGUF metadata ({exc})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tok-"))
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except OSError:
        if not (target / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return target


def ensure_cached(path: Path, cache_root: Path | None = None) -> Path:
    """The cached tokenizer directory of `path`, built first in a child process if missing."""
    target = cache_target(path, cache_root)
    if (target / "tokenizer.json").is_file():
        return target
    cmd = [sys.executable, "-m", "kvserve.model.tokenizer_cache", str(path)]
    if cache_root is not None:
        cmd.append(str(cache_root))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelFileError(f"model {path}: building its tokenizer took over {BUILD_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0 or not (target / "tokenizer.json").is_file():
        detail = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise ModelFileError(
            f"model {path}: building its tokenizer failed (exit {proc.returncode}): {detail[-1] if detail else ''}"
        )
    return target


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m kvserve.model.tokenizer_cache GGUF_FILE [CACHE_ROOT]", file=sys.stderr)
        return 2
    try:
        target = build(Path(argv[0]), Path(argv[1]) if len(argv) == 2 else None)
    except (OSError, ModelFileError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
