"""The tool-call families (kvserve.model.tool_parsers): what a reply reads as, the same whether it
arrives whole or in pieces of any size, and the grammars of replies made of calls, compiled by
llguidance on a byte-level tokenizer and run against replies they must take and refuse."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvserve.model.grammars import check, llg_tokenizer
from kvserve.model.tool_parsers import FAMILIES, Call, Tool, ToolStream, family_of, grammar
from kvserve.tools.tinymodel import BYTE_VOCAB, VOCAB_SIZE, write_tokenizer

F = Call("f", '{"x": 1}')
G = Call("g", "{}")
READS = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', ["Sure.\n", F, G]),
    ("hermes", "\n\n<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}", [F]),  # cut off: still a call
    ("hermes", "no calls here <tool", ["no calls here <tool"]),
    ("hermes", "<tool_call>{bad}</tool_call> tail", ["<tool_call>{bad}</tool_call> tail"]),
    ("llama3_json", ' {"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', [F, G]),
    ("llama3_json", "<|python_tag|>{\"name\": \"g\", \"parameters\": {}}", [G]),
    ("llama3_json", "Hello {x}", ["Hello {x}"]),
    ("llama3_json", "{not json", ["{not json"]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', [F, G]),
    ("mistral", 'Hi [TOOL_CALLS]f{"x": 1}[TOOL_CALLS]g[ARGS]{}', ["Hi ", F, G]),
    ("mistral", "plain", ["plain"]),
    # the JSON is read first: its strings may hold the closing tag
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": "</tool_call>"}}</tool_call>',
     [Call("f", '{"x": "</tool_call>"}')]),
    # a call whose closing tag never came is a call; the text after it is content
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}} and some text', [F, " and some text"]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nA\n\nB', [F, "\nA\n\nB"]),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 5000, ['<tool_call>{"name": "f", "arguments": ' + "[" * 5000]),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}} I called f.', [F, " I called f."]),
    ("llama3_json", '\r{"name": "g", "parameters": {}}', [G]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}] ok [TOOL_CALLS][{"name": "g", "arguments": {}}]',
     [F, " ok ", G]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}] A B', [F, " A B"]),
]


def _joined(items: list) -> list:
    out: list = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] += item
        else:
            out.append(item)
    return out


@pytest.mark.parametrize(("family", "text", "want"), READS)
def test_a_whole_reply_reads_as_its_content_and_calls(family: str, text: str, want: list) -> None:
    assert _joined(ToolStream(FAMILIES[family]).push(text, final=True)) == want


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(READS), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_a_reply_in_pieces_reads_as_the_whole_one(case: tuple, cuts: list[int]) -> None:
    family, text, want = case
    stream = ToolStream(FAMILIES[family])
    got, at = [], 0
    for cut in sorted(c % (len(text) + 1) for c in cuts):
        got += stream.push(text[at:cut])
        at = cut
    got += stream.push(text[at:], final=True)
    assert _joined(got) == want


def test_the_family_comes_from_the_template() -> None:
    assert family_of("{% if tools %}<tool_call>{% endif %}") is FAMILIES["hermes"]
    assert family_of("[TOOL_CALLS]") is FAMILIES["mistral"]
    assert family_of("<|python_tag|>") is FAMILIES["llama3_json"]
    assert family_of("{{ messages }}") is None


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    return tok, llg_tokenizer(tok.to_str(), VOCAB_SIZE, [BYTE_VOCAB + 1])


TOOLS = [Tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
         Tool("g", {"type": "object"})]
REPLIES = {  # text, one call, calls, a call with arguments its schema refuses
    "hermes": ["Hi", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
               '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               '{"name": "f", "arguments": {"a": 2}}\n</tool_call>',
               '<tool_call>\n{"name": "f", "arguments": {"a": "x"}}\n</tool_call>'],
    "llama3_json": ["Hi", '{"name": "f", "parameters": {"a": 1}}',
                    '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
                    '{"name": "f", "parameters": {"a": "x"}}'],
    "mistral": ["Hi", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
                '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
                '[TOOL_CALLS][{"name": "f", "arguments": {"a": "x"}}]'],
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(("many", "auto", "takes"), [
    (False, False, [False, True, False, False]), (True, False, [False, True, True, False]),
    (False, True, [True, True, False, False]), (True, True, [True, True, True, False])])
def test_a_calls_grammar_takes_the_replies_it_should(byte_tok: tuple, family: str, many: bool, auto: bool,
                                                     takes: list[bool]) -> None:
    tok, ltok = byte_tok
    text = llguidance.grammar_from("lark", grammar(FAMILIES[family], TOOLS, many, auto))
    assert check(text, ltok) == ""
    got = []
    for reply in REPLIES[family]:
        m = llguidance.LLMatcher(ltok, text)
        got.append(m.consume_tokens(tok.encode(reply, add_special_tokens=False).ids) and m.is_accepting())
    assert got == takes
    for reply, taken in zip(REPLIES[family], takes, strict=True):  # what it takes reads back as calls
        items = ToolStream(FAMILIES[family]).push(reply, final=True)
        if taken and reply != "Hi":
            assert items and all(isinstance(i, Call) and isinstance(json.loads(i.arguments), dict) for i in items)


def test_a_schema_with_defs_compiles_and_its_refs_resolve(byte_tok: tuple) -> None:
    tok, ltok = byte_tok
    params = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}, "more": {"$ref": "#/properties/unit"}},
              "required": ["unit", "more"], "additionalProperties": False,
              "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}}}
    text = llguidance.grammar_from("lark", grammar(FAMILIES["hermes"], [Tool("w", params), TOOLS[1]], False))
    assert check(text, ltok) == ""
    for args, taken in (('{"unit": "c", "more": "f"}', True), ('{"unit": "k", "more": "f"}', False)):
        m = llguidance.LLMatcher(ltok, text)
        reply = f'<tool_call>\n{{"name": "w", "arguments": {args}}}\n</tool_call>'
        assert (m.consume_tokens(tok.encode(reply, add_special_tokens=False).ids) and m.is_accepting()) is taken


def test_call_ids_are_what_each_family_takes() -> None:
    assert all(len(FAMILIES[f].call_id()) == 29 and FAMILIES[f].call_id().startswith("call_")
               for f in ("hermes", "llama3_json"))
    ids = {FAMILIES["mistral"].call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)


def test_mistral_grammar_names_a_special_marker_by_its_token(byte_tok: tuple) -> None:
    assert "mark: <[7]>" in grammar(FAMILIES["mistral"], TOOLS, True, marker_token=7)
