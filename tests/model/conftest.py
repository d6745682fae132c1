"""Model tests run torch on one thread, like the runner tests (see tests/runner/conftest.py)."""

from tests.runner.conftest import _one_thread  # noqa: F401  (an autouse fixture)
