"""Fixtures of the fault tests: the sharpened tiny model (shared with the runner tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runner.runner_procs import sharp_tiny_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama HF dir (byte tokenizer, context 512) whose greedy output depends on
    its context; written once per session."""
    return sharp_tiny_dir(tmp_path_factory)
