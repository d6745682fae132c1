"""Incremental detokenization and stop-string matching for one output stream.

`IncrementalDetokenizer` turns token ids into text deltas as they arrive and never emits
part of a UTF-8 character: while the decoded tail ends in U+FFFD (an incomplete byte
sequence) it waits for the next token. `StopMatcher` holds back just enough text to find
a stop string that spans token boundaries. `TextStream` chains the two.

This module only sees a ``decode(list[int]) -> str`` function; it knows nothing about
tokenizers, gRPC or runners.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"
WINDOW = 6  # ids kept as decoding context when the window slides


class IncrementalDetokenizer:
    """Decode a growing list of token ids into text deltas that are always whole characters.

    `context_ids` (e.g. the last prompt tokens) seed the window so that tokenizers which
    drop a leading space on the first decoded token decode the first output correctly.
    """

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(context_ids)
        self._prefix = 0  # first id of the decoded window
        self._emitted = len(decode(self._ids))  # characters of the window already emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete ("" while a character is partial)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is left at the end of the stream (an unfinished byte run decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        text = self._decode(self._ids[self._prefix :])
        safe = len(text) if final else len(text.rstrip(REPLACEMENT))
        delta = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        if safe == len(text) and len(self._ids) - self._prefix > 2 * WINDOW:
            # Everything is emitted: slide the window, keeping a little context.
            self._prefix = len(self._ids) - WINDOW
            self._emitted = len(self._decode(self._ids[self._prefix :]))
        return delta


class StopMatcher:
    """Find the first stop string in a stream of text deltas, even across delta boundaries.

    `push` returns (text safe to emit, stopped). Text that could be the start of a stop
    string is held back until the next delta shows whether it is one. Once stopped, the
    emitted text ends just before the stop string and further input is ignored.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        first = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if first >= 0:
            self._held = ""
            self.stopped = True
            return text[:first], True
        hold = self._longest_partial_suffix(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _longest_partial_suffix(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[len(text) - n :]):
                    best = n
                    break
        return best


@dataclass(slots=True)
class TextStream:
    """Detokenizer + stop matcher for one request: token ids in, safe text deltas out."""

    detok: IncrementalDetokenizer
    matcher: StopMatcher
    text: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, decode: Callable[[list[int]], str], stops: Sequence[str] = (),
               context_ids: Sequence[int] = ()) -> TextStream:
        return cls(IncrementalDetokenizer(decode, context_ids), StopMatcher(stops))

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Return (text delta, stopped by a stop string)."""
        out, stopped = self.matcher.push(self.detok.push(token_ids))
        self.text.append(out)
        return out, stopped

    def finish(self) -> str:
        """Text left at the end of a stream that was not stopped by a stop string."""
        out, stopped = self.matcher.push(self.detok.flush())
        out = out + ("" if stopped else self.matcher.flush())
        self.text.append(out)
        return out

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped
