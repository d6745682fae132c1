"""Fixtures of the fault tests: the sharpened tiny model in shapes the native int4 kernel
takes, which the fault tests serve on the default path (`harness.DEFAULT_PATH`): batch-
invariant (issue 36), so that a token that differs after a fault means corruption."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runner.runner_procs import sharp_int4_tiny_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama HF dir (byte tokenizer, context 512) whose greedy output depends on
    its context; written once per session."""
    return sharp_int4_tiny_dir(tmp_path_factory)
