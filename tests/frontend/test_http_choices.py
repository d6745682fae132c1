"""Choices' merging of n streams (unit tests of the logic, on a stand-in request path; the
served behaviour is in test_http_api.py): a failure in any choice ends the merged stream
with that error instead of leaving it waiting, and the held seats are given back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from kvserve.frontend.http_choices import Choices
from kvserve.frontend.requests import Rejected, Step, Usage


class _Path:
    """admit / steps / close / release as Choices calls them; choice `broken` raises `error`."""

    def __init__(self, broken: int, error: Exception) -> None:
        self.broken, self.error = broken, error
        self.held, self.closed, self.admitted = 0, [], []

    def admit(self, request_id: str, prep: object, arrival: float, held: bool = False) -> SimpleNamespace:
        assert held
        self.held -= 1
        self.admitted.append(request_id)
        return SimpleNamespace(request_id=request_id, index=len(self.admitted), usage=Usage(prompt=3))

    async def steps(self, call: SimpleNamespace) -> AsyncIterator[Step]:
        yield Step([1], "a")
        if call.index == self.broken:
            raise self.error
        await asyncio.sleep(0.01)
        yield Step([2], "b", finish_reason="length", usage=call.usage)

    def close(self, call: SimpleNamespace) -> None:
        self.closed.append(call.request_id)

    def release(self, seats: int) -> None:
        self.held += seats


async def _run(path: _Path, n: int) -> list[tuple[int, str]]:
    path.held = n - 1  # as admit(seats=n) leaves it
    prep = SimpleNamespace(params=SimpleNamespace(seed=None))
    first = SimpleNamespace(request_id="r", index=0, usage=Usage(prompt=3))
    choices = Choices(path, first, prep, "r", n, 0.0)  # type: ignore[arg-type]
    got = []
    async with asyncio.timeout(5):  # a hang fails here
        async for index, step in choices.steps():
            got.append((index, step.text))
    return got


@pytest.mark.parametrize("error", [RuntimeError("a bug in the pump"), Rejected("UNAVAILABLE", "runner gone")])
def test_a_choice_that_fails_ends_the_merged_stream_with_its_error(error: Exception) -> None:
    path = _Path(broken=2, error=error)
    with pytest.raises(type(error), match=str(error)):
        asyncio.run(_run(path, 4))
    assert sorted(path.closed) == sorted(["r", *path.admitted])
    assert path.held == 0  # the seats no choice took are given back


def test_choices_without_a_failure_all_finish() -> None:
    path = _Path(broken=-1, error=RuntimeError())
    got = asyncio.run(_run(path, 3))
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert path.held == 0 and len(path.admitted) == 2
