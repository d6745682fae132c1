"""Incremental detokenization and stop-string matching for one output stream.

`IncrementalDetokenizer` turns token ids into text deltas as they arrive on top of
`tokenizers.decoders.DecodeStream` (in Rust), which holds back a token while the decoded
text ends in U+FFFD (an incomplete UTF-8 character) and so never emits half a character.
The stream is seeded with the prompt's last tokens, so that decoders which drop the leading
space of the first token (SentencePiece) decode the first output token as it reads after the
prompt. Two things DecodeStream leaves to us: a real U+FFFD that the model emitted (it would
be held until the stream ends), and the text still held when the stream ends.
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

RESEED = 4  # ids kept as decoding context when the stream is restarted
MAX_PENDING = 32  # held ids after which the held text is released as it decodes


class StreamTokenizer(Protocol):
    backend: Tokenizer
    stable_replacement: bool  # a U+FFFD followed by more decoded text never changes


class IncrementalDetokenizer:
    """Decode a growing list of token ids into text deltas that are always whole characters.

    The concatenated deltas equal ``decode(context_ids + ids)[len(decode(context_ids)):]``
    once the stream is flushed, and after every push whose text ends on a whole character.
    """

    def __init__(self, tok: StreamTokenizer, context_ids: Sequence[int] = ()) -> None:
        self._tok = tok.backend
        self._stable = tok.stable_replacement
        self._start(list(context_ids))

    def _start(self, context: list[int]) -> None:
        # Mirrors DecodeStream's own state: `_context` is the chunk it decodes the next text
        # against (the ids of the last delta), `_pending` what it holds back since.
        self._stream = DecodeStream(context, skip_special_tokens=True)
        self._context = context
        self._pending: list[int] = []

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete ("" while a character is partial)."""
        if not token_ids:
            return ""
        ids = list(token_ids)
        try:
            chunk = self._stream.step(self._tok, ids)
        except Exception:  # tokenizers' bare Exception: the text before the held tail changed
            self._pending += ids
            return self._restart(self._pending)
        if chunk is not None:
            self._context = self._pending + ids
            self._pending = []
            return chunk
        self._pending += ids
        if len(self._pending) > MAX_PENDING:
            return self._restart(self._pending)
        if self._stable and len(self._pending) > 1:
            return self._release_final_replacement()
        return ""

    def flush(self) -> str:
        """Return the text still held at the end of the stream (an unfinished character decodes to U+FFFD)."""
        if not self._pending:
            return ""
        return self._restart(self._pending)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def _restart(self, held: list[int]) -> str:
        """Emit `held` as it decodes now and restart the stream after it."""
        ids = self._context + held
        text = self._decode(ids)
        delta = text[len(self._decode(self._context)) :]
        self._start(ids[-RESEED:])
        return delta

    def _release_final_replacement(self) -> str:
        """The held text ends in U+FFFD. When the text before the newest token also ends in
        U+FFFD and is a strict prefix of the whole, that U+FFFD has been followed by more
        text, so it is a finished one (a real U+FFFD, or bytes that can no longer complete):
        emit up to it rather than hold it until the stream ends."""
        head_ids = self._context + self._pending[:-1]
        base, head = self._decode(self._context), self._decode(head_ids)
        text = self._decode(head_ids + self._pending[-1:])
        if not (len(text) > len(head) > len(base) and text.startswith(head) and head.startswith(base)):
            return ""
        newest = self._pending[-1:]
        self._start(self._pending[:-1])
        return head[len(base) :] + self.push(newest)


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
