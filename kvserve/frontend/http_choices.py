"""The n choices of one OpenAI request (`n` > 1): one prompt prefilled once, its KV shared.

Choice 0 is admitted first; the other n - 1 are admitted when its first token arrives, that is
once its prefill is done and committed to memsvc's prefix cache, so each of them finds the
prompt's whole blocks there and computes only the last, partial one. They run as separate
requests on the runners (ids `choice_id(<id>, i)`), each with its own finish reason; their seats
are held from choice 0's admission, so a request that fits never fails halfway for want of them.
A seeded request gives choice i the seed ``seed + i * GOLDEN`` (mod 2**64): choice 0 draws what
an n = 1 request with that seed draws, and the others are reproducible but not copies of it.
A greedy request's choices are equal, as they are elsewhere.

`Choices.steps()` merges the n streams as (choice index, `Step`) in arrival order; when it
ends, for any reason, every call is closed (aborted if still running). Knows the request path
and asyncio; nothing about HTTP shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import msgspec

from kvserve.frontend.dispatch import choice_id
from kvserve.frontend.requests import Call, Rejected, RequestPath, Step, Usage
from kvserve.frontend.validation import Prepared
from kvserve.messages.frontend_runner import FinishReason

GOLDEN = 0x9E37_79B9_7F4A_7C15
MAX_N = 128
"""The most choices one request may ask for (OpenAI's own limit)."""


def choice_prep(prep: Prepared, index: int) -> Prepared:
    """`prep` for choice `index`: its own seed where the request has one."""
    seed = prep.params.seed
    if index == 0 or seed is None:
        return prep
    params = msgspec.structs.replace(prep.params, seed=(seed + index * GOLDEN) % 2**64)
    return dataclasses.replace(prep, params=params)


class Choices:
    """The calls of one request's n choices, choice 0 already admitted."""

    def __init__(self, path: RequestPath, first: Call, prep: Prepared, request_id: str, n: int,
                 arrival: float) -> None:
        self.path = path
        self.calls = [first]
        self.prep = prep
        self.request_id = request_id or first.request_id
        self.n = n
        self.arrival = arrival
        self._aborted = False  # a choice ended by `Abort`: the choices not admitted yet end so too
        self._held = n - 1  # seats `admit(seats=n)` holds for the choices not admitted yet
        self._tasks: list[asyncio.Task] = []  # the pumps and the task admitting choices 1..n-1

    def usage(self) -> Usage:
        """The prompt once (and what choice 0 found cached), the completions of every choice."""
        u = Usage(prompt=self.calls[0].usage.prompt, cached=self.calls[0].usage.cached)
        u.completion = sum(c.usage.completion for c in self.calls)
        return u

    def close(self) -> None:
        for call in self.calls:
            self.path.close(call)
        self.path.release(self._held)
        self._held = 0

    async def steps(self) -> AsyncIterator[tuple[int, Step]]:
        if self.n == 1:
            async for step in self.path.steps(self.calls[0]):
                yield 0, step
            return
        queue: asyncio.Queue[tuple[int, Step | Exception | None]] = asyncio.Queue()
        started = asyncio.Event()
        self._tasks += [asyncio.create_task(self._pump(0, self.calls[0], queue, started)),
                        asyncio.create_task(self._start_rest(queue, started))]
        live = self.n
        try:
            while live:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    live -= 1
                    continue
                yield index, item
        finally:
            for task in self._tasks:
                task.cancel()
            self.close()

    async def _pump(self, index: int, call: Call, queue: asyncio.Queue, started: asyncio.Event) -> None:
        try:
            async for step in self.path.steps(call):
                self._aborted |= step.finish_reason == FinishReason.ABORT
                started.set()
                await queue.put((index, step))
        except Exception as exc:  # Rejected, or a bug: either ends the merged stream, never hangs it
            await queue.put((index, exc))
            return
        finally:
            started.set()
        await queue.put((index, None))

    async def _start_rest(self, queue: asyncio.Queue, started: asyncio.Event) -> None:
        try:
            await self._admit_rest(queue, started)
        except Exception as exc:  # a bug here ends the merged stream rather than hanging it
            await queue.put((0, exc))

    async def _admit_rest(self, queue: asyncio.Queue, started: asyncio.Event) -> None:
        await started.wait()  # choice 0's prefill is committed: the others find its blocks cached
        if self._aborted:  # choice 0 was aborted before its first token: so are the others
            for index in range(1, self.n):
                await queue.put((index, Step([], "", [], finish_reason=FinishReason.ABORT, usage=Usage(prompt=0))))
                await queue.put((index, None))
            return
        for index in range(1, self.n):  # all in one turn of the loop: an Abort finds all or none
            try:
                call = self.path.admit(choice_id(self.request_id, index), choice_prep(self.prep, index),
                                       self.arrival, held=True)
            except Rejected as exc:
                await queue.put((index, exc))
                return
            self._held -= 1
            self.calls.append(call)
            self._tasks.append(asyncio.create_task(self._pump(index, call, queue, started)))
