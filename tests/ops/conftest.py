"""Fixtures of the ops tests: the real tools (promtool, systemd-analyze) or a clear skip."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool (Debian package `prometheus`, installed by .ci/run)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: install the Debian package `prometheus` "
                    "(.ci/run does it with apt-get when it can)")
    return path


@pytest.fixture(scope="session")
def systemd_analyze() -> str:
    """Path of systemd-analyze (Debian package `systemd`, installed by .ci/run)."""
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze not found: install the Debian package `systemd` "
                    "(.ci/run does it with apt-get when it can)")
    return path
