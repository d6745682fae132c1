"""Incremental detokenization (never broken UTF-8) and stop strings across token boundaries.

The property tests push random id sequences (whole vocabulary, single-byte tokens, encoded
text with multi-byte characters and U+FFFD) in random chunks through the detokenizer, on
the byte tokenizer, the real default-model tokenizer (byte-level BPE) and a SentencePiece-
style tokenizer with byte-fallback tokens: the concatenated deltas must equal the decoded
text whenever that text does not end in U+FFFD, and, on decoders without byte fallback, all
of it but that U+FFFD when it does (a real U+FFFD holds back nothing but itself).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvserve.frontend.detok import MAX_HELD, IncrementalDetokenizer, StopMatcher, TextStream
from kvserve.model.tokenizer import ByteTokenizer, ModelTokenizer, load_model_tokenizer

TOK = ByteTokenizer()
FFFD = "\ufffd"
ALPHABET = "ab é€你😀\ufffd\n"


def _sentencepiece_like() -> ModelTokenizer:
    """A Llama-2-style tokenizer: Unigram pieces with '▁' for spaces, byte-fallback tokens
    <0x00>..<0xFF> for everything else, and a decoder that strips the first leading space."""
    pieces = [("<unk>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    pieces += [(p, -1.0) for p in ("▁", "▁Hello", "▁world", "▁a", "▁b", "a", "b", "é", "\n")]
    backend = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return ModelTokenizer(backend, name="sp", vocab_size=len(pieces), eos_token_ids=[], max_context_len=64,
                          chat=None)


SP = _sentencepiece_like()


@pytest.fixture(scope="module")
def model_tok() -> ModelTokenizer:
    return load_model_tokenizer(None)


def _run(tok: ModelTokenizer, context: list[int], ids: list[int], chunks: list[int]) -> None:
    """Push `ids` in `chunks`, checking the deltas against decode() after every push."""
    base = tok.backend.decode(context, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok, context)
    got, i, k = "", 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        got += detok.push(ids[i : i + n])
        i, k = i + n, k + 1
        want = tok.backend.decode(context + ids[:i], skip_special_tokens=True)[len(base) :]
        if not want.endswith(FFFD):
            assert got == want, (ids[:i], got, want)
        elif tok.stable_replacement:  # byte fallback decodes an unfinished run as all U+FFFD
            # only the last character, which may be unfinished, is held: a real U+FFFD
            # before it, and the text before a real U+FFFD at the end, are out
            assert got == want[:-1], (ids[:i], got, want)
    got += detok.flush()
    assert got == tok.backend.decode(context + ids, skip_special_tokens=True)[len(base) :]


def _pieces(tok: ModelTokenizer, byte_ids: list[int], vocab: int) -> st.SearchStrategy[list[int]]:
    piece = st.one_of(
        st.integers(0, vocab - 1).map(lambda i: [i]),
        st.sampled_from(byte_ids).map(lambda i: [i]),
        st.text(ALPHABET, min_size=1, max_size=6).map(tok.encode),
    )
    return st.lists(piece, max_size=24).map(lambda ps: [i for p in ps for i in p])


CHUNKS = st.lists(st.integers(1, 4), max_size=8)
CONTEXT = st.text("ab é你", max_size=6)


@settings(max_examples=300, deadline=None)
@given(_pieces(TOK, list(range(256)), 257), CHUNKS, CONTEXT)
def test_property_byte_tokenizer(ids: list[int], chunks: list[int], context: str) -> None:
    _run(TOK, TOK.encode(context), ids, chunks)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_default_model_tokenizer(model_tok: ModelTokenizer, data: st.DataObject) -> None:
    # Single-byte tokens: the byte-level alphabet's characters, parts of multi-byte ones.
    byte_ids = [i for i in map(model_tok.backend.token_to_id, pre_tokenizers.ByteLevel.alphabet()) if i is not None]
    assert len(byte_ids) > 200
    ids = data.draw(_pieces(model_tok, byte_ids, model_tok.vocab_size))
    _run(model_tok, model_tok.encode(data.draw(CONTEXT)), ids, data.draw(CHUNKS))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(ALPHABET, min_size=1, max_size=6), max_size=12), CHUNKS, CONTEXT)
def test_property_byte_fallback_tokenizer(texts: list[str], chunks: list[int], context: str) -> None:
    # Byte-fallback decoding re-reads a whole run of byte tokens, so only valid UTF-8 runs
    # decode consistently prefix by prefix: the ids are pieces of encoded text.
    ids = [i for t in texts for i in SP.encode(t)]
    assert any(SP.backend.id_to_token(i).startswith("<0x") for i in SP.encode("€"))
    _run(SP, SP.encode(context), ids, chunks)


def test_context_gives_the_first_token_its_leading_space() -> None:
    prompt, out = SP.encode("a"), SP.encode("Hello world")
    assert SP.decode(out) == "Hello world"  # decoded alone, the leading space is stripped
    ts = TextStream.create(SP, (), prompt)
    text = "".join(ts.push([i])[0] for i in out) + ts.finish()
    assert text == " Hello world"


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    detok = IncrementalDetokenizer(TOK)
    euro = "€".encode()  # 3 bytes
    assert detok.push([ord("a")]) == "a"
    assert detok.push([euro[0]]) == ""
    assert detok.push([euro[1]]) == ""
    assert detok.push([euro[2]]) == "€"
    assert detok.push([ord("b")]) == "b"
    assert detok.flush() == ""


def test_truncated_character_at_end_is_flushed_as_replacement() -> None:
    detok = IncrementalDetokenizer(TOK)
    assert detok.push(list(b"ok") + ["é".encode()[0]]) == "ok"
    assert detok.flush() == FFFD


def test_real_replacement_characters_stream_one_behind(model_tok: ModelTokenizer) -> None:
    """A U+FFFD the model emits is released once the next token shows it is finished."""
    (fffd,) = model_tok.encode(FFFD)
    detok = IncrementalDetokenizer(model_tok, model_tok.encode("x"))
    assert detok.push(model_tok.encode(" a")) == " a"
    assert [detok.push([fffd]) for _ in range(4)] == ["", FFFD, FFFD, FFFD]
    assert detok.push(model_tok.encode("b")) == FFFD + "b"
    assert detok.push([fffd]) == ""
    assert detok.flush() == FFFD


def test_real_replacement_character_from_bytes() -> None:
    detok = IncrementalDetokenizer(TOK)
    raw = list(f"a{FFFD}{FFFD}b".encode())
    deltas = [detok.push([b]) for b in raw] + [detok.flush()]
    assert "".join(deltas) == f"a{FFFD}{FFFD}b"
    assert deltas[:5] == ["a", "", "", "", FFFD]  # the first one as soon as the second one starts


def test_rewritten_text_keeps_the_stream_going() -> None:
    """Byte fallback turns an emitted 'é' into U+FFFDs when a stray byte joins its run
    (tokenizers' DecodeStream raises there); the emitted text stands and the rest follows."""
    c3, a9, b = SP.backend.token_to_id("<0xC3>"), SP.backend.token_to_id("<0xA9>"), SP.encode("b")
    detok = IncrementalDetokenizer(SP, SP.encode("a"))
    assert detok.push([c3, a9]) == "é"
    assert detok.push([c3]) == ""
    assert detok.push(b) == FFFD + FFFD + " b"
    assert detok.push(SP.encode("a")) == " a"


def test_special_and_unknown_ids_decode_to_nothing() -> None:
    detok = IncrementalDetokenizer(TOK)
    assert [detok.push([256, 9999]) for _ in range(3 * MAX_HELD)] == [""] * (3 * MAX_HELD)
    assert detok.push([ord("z")]) == "z"


def test_long_hold_on_byte_fallback_is_released_on_a_whole_character() -> None:
    """Byte fallback cannot tell a real U+FFFD from an unfinished run of bytes. Pushes that
    all end inside a character are held, but past MAX_HELD ids the text up to the last whole
    character goes out; a run of U+FFFD itself comes out when the run ends."""
    n = MAX_HELD // 4
    text = " ".join(["€😀"] * n)
    ids = SP.encode(text)  # per "€😀": "▁", then 7 byte tokens; the next "▁" ends the run
    assert len(ids) == 8 * n
    detok = IncrementalDetokenizer(SP, SP.encode("a"))
    pushes = [ids[:2]] + [ids[i : i + 8] for i in range(2, len(ids), 8)]  # each ends 1 byte into "€"
    deltas = [detok.push(p) for p in pushes]
    early = "".join(deltas[:-1])
    assert deltas[: MAX_HELD // 8 - 1] == [""] * (MAX_HELD // 8 - 1)
    assert early.startswith(" €😀" * (MAX_HELD // 8)) and (" " + text).startswith(early)
    assert early + deltas[-1] + detok.flush() == " " + text

    run = SP.encode("é" + FFFD * MAX_HELD + "b")
    detok = IncrementalDetokenizer(SP, SP.encode("a"))
    deltas = [detok.push([i]) for i in run]
    assert "".join(deltas[:-1]) == " é" and deltas[-1] == FFFD * MAX_HELD + " b"[1:]


def _stream_bytes(text: str, chunks: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(TOK)
    ids = TOK.encode(text)
    out, i = [], 0
    for n in chunks:
        out.append(detok.push(ids[i : i + n]))
        i += n
    out.append(detok.push(ids[i:]))
    out.append(detok.flush())
    return out


TEXT = st.text(st.one_of(st.characters(exclude_categories=("Cs",)), st.just(FFFD)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(TEXT, st.lists(st.integers(1, 4), max_size=40))
def test_deltas_are_the_whole_characters_pushed(text: str, chunks: list[int]) -> None:
    """After every push the deltas are the text of every character whose bytes are all in,
    except a U+FFFD that the pushed bytes end with (it could be an unfinished character as
    far as the decoder can tell); the text before it is out."""
    deltas = _stream_bytes(text, chunks)
    assert "".join(deltas) == text
    ends = [0]  # byte offset where each character ends
    for ch in text:
        ends.append(ends[-1] + len(ch.encode()))
    got, pushed = "", 0
    for n, delta in zip([*chunks, ends[-1]], deltas, strict=False):  # the last push: the rest
        got += delta
        pushed = min(pushed + n, ends[-1])
        whole = text[: sum(1 for e in ends[1:] if e <= pushed)]
        want = whole[:-1] if pushed == ends[len(whole)] and whole.endswith(FFFD) else whole
        assert got == want, (pushed, got, want)


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
    ts = TextStream.create(TOK, [stop])
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
