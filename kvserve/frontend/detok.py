"""Incremental detokenization and stop-string matching for one output stream.

`IncrementalDetokenizer` turns token ids into text deltas as they arrive on top of
`tokenizers.decoders.DecodeStream` (in Rust), which holds back a token while the decoded
text ends in U+FFFD (an incomplete UTF-8 character) and so never emits half a character.
The stream is seeded with the prompt's last tokens, so that decoders which drop the leading
space of the first token (SentencePiece) decode the first output token as it reads after the
prompt. What DecodeStream leaves to us: a real U+FFFD that the model emitted (it would be
held until the stream ends), a decoder that rewrites text already emitted (byte fallback
meeting a stray byte), and the text still held when the stream ends.
`StopMatcher` holds back just enough text to find a stop string that spans token
boundaries. `TextStream` chains the two.

This module sees a `tokenizers.Tokenizer` (through `StreamTokenizer`); it knows nothing
about gRPC, runners or where the tokenizer came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

MAX_HELD = 64  # ids held behind a U+FFFD before a look for text to release (_release_long_hold)
TAIL_IDS = 4  # ids that hold every byte of an unfinished character (at most 3 bytes, 1+ per id)
REPLACEMENT = "\ufffd"


class StreamTokenizer(Protocol):
    backend: Tokenizer
    stable_replacement: bool  # a U+FFFD followed by more decoded text never changes
    silent_ids: frozenset[int]  # ids that decode to nothing (special tokens) ...
    known_ids: int  # ... and ids at or past this one


class IncrementalDetokenizer:
    """Decode a growing list of token ids into text deltas that are always whole characters.

    The concatenated deltas equal ``decode(context_ids + ids)[len(decode(context_ids)):]``
    once the stream is flushed, and after every push whose text does not end in U+FFFD. When
    it does (an unfinished character, or a real U+FFFD: the decoded text cannot tell), they
    equal all of it but that last U+FFFD on a decoder without byte fallback.

    State: `_window`, the ids decoded together, of which the first `_ctx` are context whose
    text is already emitted. On the fast path DecodeStream holds the same window. It cannot
    hold a window whose emitted text ends in U+FFFD (it would emit that text again), so
    after a U+FFFD is released, or when DecodeStream finds the emitted text rewritten, the
    window is decoded here (`_emitted` characters of it sent) until it ends on a whole
    character again.
    """

    __slots__ = ("_tok", "_stable", "_silent", "_known", "_window", "_ctx", "_emitted", "_stream",
                 "_hold_limit")

    def __init__(self, tok: StreamTokenizer, context_ids: Sequence[int] = ()) -> None:
        self._tok = tok.backend
        self._stable = tok.stable_replacement
        self._silent = tok.silent_ids
        self._known = tok.known_ids
        self._window: list[int] = self._audible(context_ids)
        text = self._decode(self._window)
        self._ctx = len(self._window)
        self._emitted = len(text)
        self._stream: DecodeStream | None = None
        self._hold_limit = MAX_HELD  # held ids at which a long hold is looked at
        if not text.endswith(REPLACEMENT):
            self._start_stream()

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete ("" while a character is partial)."""
        window = self._window
        if len(token_ids) == 1:  # the usual push: one decode step, kept lean
            step: int | list[int] = token_ids[0]
            if step >= self._known or step in self._silent:
                return ""
            window.append(step)
        else:
            step = self._audible(token_ids)
            if not step:
                return ""
            window += step
        if self._stream is None:
            return self._advance()
        try:
            chunk = self._stream.step(self._tok, step)
        except Exception:  # tokenizers' bare Exception: the text already emitted was rewritten
            return self._leave_fast_path()
        if chunk is not None:
            del window[: self._ctx]
            self._ctx = len(window)
            return chunk
        # Held text of one character is one unfinished character: DecodeStream waits for it.
        # With more (even from one id), all but the last are finished, a U+FFFD among them
        # (a real one, or bytes that can no longer complete) too: `_advance` releases them.
        if len(window) - self._ctx >= self._hold_limit or (
                self._stable and len(self._decode(window[self._ctx :])) > 1):
            return self._leave_fast_path()
        return ""

    def flush(self) -> str:
        """Return the text still held at the end of the stream (an unfinished character decodes to U+FFFD)."""
        if self._stream is not None and self._ctx == len(self._window):
            return ""
        if self._stream is not None:
            self._emitted = len(self._decode(self._window[: self._ctx]))
        text = self._decode(self._window)
        delta = text[self._emitted :]
        self._emitted = len(text)
        self._stream = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def _audible(self, ids: Sequence[int]) -> list[int]:
        # decode() drops special and unknown ids before its decoder runs, so dropping them
        # here changes no text, and a run of them cannot grow the window.
        return [i for i in ids if i < self._known and i not in self._silent]

    def _start_stream(self) -> None:
        """Hand the window to a new DecodeStream; its text (all emitted) ends on a whole character."""
        self._stream = DecodeStream(self._window, skip_special_tokens=True)
        self._ctx = len(self._window)
        self._hold_limit = MAX_HELD

    def _leave_fast_path(self) -> str:
        self._emitted = len(self._decode(self._window[: self._ctx]))
        self._stream = None
        return self._advance()

    def _advance(self) -> str:
        """Decode the window here; back to DecodeStream once it ends on a whole character."""
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT):
            self._start_stream()
            return text[self._emitted :]
        if self._stable and len(text) - 1 > self._emitted:
            # Only the last character can still change (a U+FFFD followed by more text never
            # does): every character before it is finished, a real U+FFFD among them or not,
            # so emit them now. Keep only the last TAIL_IDS ids, which hold every byte of that
            # last character: decoding restarts in step with the full window from there.
            delta = text[self._emitted : len(text) - 1]
            del self._window[:-TAIL_IDS]
            self._emitted = len(self._decode(self._window)) - 1
            self._ctx, self._hold_limit = 0, MAX_HELD
            return delta
        if len(self._window) - self._ctx >= self._hold_limit:
            return self._release_long_hold(text)
        return ""

    def _release_long_hold(self, text: str) -> str:
        """Many ids held and the text still ends in U+FFFD (on a byte-fallback decoder, where
        a real U+FFFD looks like an unfinished run of bytes): emit up to the longest prefix of
        ids whose text ends on a whole character and starts `text`, and hold the rest on the
        fast path. With none (a run of U+FFFD), hold on, looking again MAX_HELD ids later."""
        for k in range(len(self._window) - 1, 0, -1):
            head = self._decode(self._window[:k])
            if len(head) <= self._emitted:
                break
            if not head.endswith(REPLACEMENT) and text.startswith(head):
                rest = self._window[k:]
                self._window = self._window[:k]
                self._start_stream()
                return head[self._emitted :] + self.push(rest)
        self._hold_limit = len(self._window) - self._ctx + MAX_HELD
        return ""


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

    @classmethod
    def create(cls, tok: StreamTokenizer, stops: Sequence[str] = (),
               context_ids: Sequence[int] = ()) -> TextStream:
        return cls(IncrementalDetokenizer(tok, context_ids), StopMatcher(stops))

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Return (text delta, stopped by a stop string)."""
        return self.matcher.push(self.detok.push(token_ids))

    def finish(self) -> str:
        """Text left at the end of a stream that was not stopped by a stop string."""
        out, stopped = self.matcher.push(self.detok.flush())
        return out + ("" if stopped else self.matcher.flush())

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped
