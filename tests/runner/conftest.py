"""Runner tests run torch on one thread: with 2 cores shared by the whole suite (and by the
memsvc/runner processes some tests start), OpenMP spinning only costs, and the tiny model is
far faster on one thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
