"""Unit tests of the admission policies and their registry."""

from __future__ import annotations

import pytest

from kvserve.memsvc.policy import POLICIES, OptimisticPolicy, ReservePolicy, make_policy


def test_registry() -> None:
    assert set(POLICIES) == {"reserve", "optimistic"}
    assert isinstance(make_policy("reserve", 8), ReservePolicy)
    assert isinstance(make_policy("optimistic", 8), OptimisticPolicy)
    with pytest.raises(ValueError, match="optimistic, reserve"):
        make_policy("greedy", 8)


def test_capacities() -> None:
    assert make_policy("reserve", 8).admit_capacity(100, 50) == 150
    assert make_policy("optimistic", 8).admit_capacity(100, 50) == 108
    assert make_policy("optimistic", 8).admit_capacity(100, 3) == 103
