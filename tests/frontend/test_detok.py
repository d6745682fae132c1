"""Incremental detokenization (never broken UTF-8) and stop strings across token boundaries."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.frontend.detok import IncrementalDetokenizer, StopMatcher, TextStream
from kvserve.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _stream_bytes(text: str, chunks: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(TOK.decode)
    ids = TOK.encode(text)
    out, i = [], 0
    for n in chunks:
        out.append(detok.push(ids[i : i + n]))
        i += n
    out.append(detok.push(ids[i:]))
    out.append(detok.flush())
    return out


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    detok = IncrementalDetokenizer(TOK.decode)
    euro = "€".encode()  # 3 bytes
    assert detok.push([ord("a")]) == "a"
    assert detok.push([euro[0]]) == ""
    assert detok.push([euro[1]]) == ""
    assert detok.push([euro[2]]) == "€"
    assert detok.push([ord("b")]) == "b"
    assert detok.flush() == ""


def test_truncated_character_at_end_is_flushed_as_replacement() -> None:
    detok = IncrementalDetokenizer(TOK.decode)
    assert detok.push(list(b"ok") + ["é".encode()[0]]) == "ok"
    assert detok.flush() == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=40), st.lists(st.integers(1, 4), max_size=40))
def test_deltas_concatenate_to_text_and_are_whole_characters(text: str, chunks: list[int]) -> None:
    deltas = _stream_bytes(text, chunks)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_across_token_boundaries() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("hello S") == ("hello ", False)
    assert m.push("T") == ("", False)
    assert m.push("OP and more") == ("", True)
    assert m.stopped and m.push("x") == ("", True)


def test_false_start_of_stop_string_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("ART") == ("START", False)
    assert m.flush() == ""
    m2 = StopMatcher(["</end>"])
    assert m2.push("a</e") == ("a", False)
    assert m2.flush() == "</e"


def test_earliest_of_several_stop_strings_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == ("hel", True)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcSTOP€ ", max_size=30), st.integers(0, 2**32))
def test_text_stream_matches_reference_truncation(text: str, seed: int) -> None:
    stop = "STOP"
    ids = TOK.encode(text)
    rng = random.Random(seed)
    ts = TextStream.create(TOK.decode, [stop])
    out, i = [], 0
    while i < len(ids) and not ts.stopped:
        n = rng.randint(1, 3)
        delta, _ = ts.push(ids[i : i + n])
        out.append(delta)
        i += n
    if not ts.stopped:
        out.append(ts.finish())
    expected = text.split(stop)[0]
    assert "".join(out) == expected
    assert ts.stopped == (stop in text)
