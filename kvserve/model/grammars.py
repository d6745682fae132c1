"""Structured outputs' grammars, through llguidance: a request's constraint as grammar text,
checked against the model's tokenizer.

A constraint is one of `KINDS` with its value: a JSON schema (JSON text), any JSON object,
a regular expression, a list of choices, or a GBNF / Lark grammar. `grammar_text(kind,
value)` turns it into llguidance's grammar text, `check(grammar, tokenizer)` compiles it and
returns llguidance's error ("" when it compiles), `llg_tokenizer(json, n_vocab, eos)` is the
tokenizer the matchers run on. `GrammarCache` keeps the verdicts of the last schemas seen, so
an agent sending the same schema on every request compiles it once per process.

The frontend (torch-free) compiles every constraint here to refuse a bad one with a 400 before
it reaches a runner; the runner builds its matchers from the same grammar text
(`kvserve.runner.grammar`). llguidance was measured against xgrammar on this project's
tokenizer (bench/grammar_libs.py): it imports neither torch nor transformers, a new grammar is
ready in 1-2 ms (xgrammar compiles eagerly, 5-28 ms), and a batch's masks cost 4-6 us a row
in both. Knows llguidance and JSON; nothing about requests, HTTP or the model.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 4096
CACHE_SIZE = 512
"""Constraints whose verdict a `GrammarCache` keeps (least recently used go first)."""
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as models write it and OpenAI returns it (`{"a": 1, "b": [2, 3]}`): one layout, so a
model cannot wander into whitespace until its tokens run out."""
LIMITS = llguidance.LLParserLimits()
"""llguidance's defaults bound the work one grammar may cost: its lexer's and parser's fuel
per mask, and the size of a grammar (500,000 symbols); a grammar past them is refused."""


class GrammarError(ValueError):
    """A constraint that cannot be compiled; str() says which part and why."""


def grammar_text(kind: str, value: Any) -> str:
    """llguidance's grammar text for the constraint `kind` with `value` (the schema's JSON text,
    True, the regex, the list of choices or the grammar); GrammarError for one that is
    malformed before it reaches the compiler."""
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise GrammarError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema is a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if kind == "regex":
        return llguidance.grammar_from("regex", value)
    if kind == "choice":
        if not value:
            raise GrammarError("no choices given")
        if len(value) > MAX_CHOICES:
            raise GrammarError(f"{len(value)} choices is more than the limit of {MAX_CHOICES}")
        for i, choice in enumerate(value):
            if not isinstance(choice, str) or not choice:
                raise GrammarError(f"choice {i} is not a non-empty string")
        return llguidance.grammar_from("choice", json.dumps(list(value)))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", value)
        except ValueError as exc:  # GBNF that does not convert
            raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown constraint kind {kind!r} (expected one of {', '.join(KINDS)})")


def llg_tokenizer(tokenizer_json: str, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The tokenizer llguidance masks for: `tokenizer_json` (a tokenizers.Tokenizer's
    to_str()), `n_vocab` the width of the model's logits. Its token slices are llguidance's
    JSON ones: a new matcher's first mask took 59 us with them, 1.4 ms with the general ones
    (bench/grammar_libs.py, a person schema on the default model's tokenizer)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_token_ids) or None,
                                  slices=llguidance.LLTokenizer.json_slices())


def check(grammar: str, tokenizer: llguidance.LLTokenizer) -> str:
    """Compile `grammar` for `tokenizer`: llguidance's error, "" when it compiles."""
    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=LIMITS)


class GrammarCache:
    """The verdicts of recent constraints: (kind, value) -> grammar text, or the GrammarError."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self._seen: OrderedDict[tuple[str, str], str | GrammarError] = OrderedDict()
        self._lock = threading.Lock()  # callers run in worker threads
        self.compiled = 0  # how many constraints were compiled (cache misses)

    def grammar(self, kind: str, value: Any) -> str:
        """The grammar text of the constraint, compiled and checked (once per constraint while
        it stays in the cache); raises GrammarError naming what the compiler refused."""
        key = (kind, value if isinstance(value, str) else json.dumps(value))
        with self._lock:
            verdict = self._seen.get(key)
            if verdict is not None:
                self._seen.move_to_end(key)
        if verdict is None:
            try:
                text = grammar_text(kind, value)
                error = check(text, self.tokenizer)
                verdict = GrammarError(error) if error else text
            except GrammarError as exc:
                verdict = exc
            except (ValueError, RecursionError) as exc:  # what llguidance raises for some inputs
                verdict = GrammarError(str(exc) or type(exc).__name__)
            with self._lock:
                self.compiled += 1
                self._seen[key] = verdict
                while len(self._seen) > self.size:
                    self._seen.popitem(last=False)
        if isinstance(verdict, GrammarError):
            raise GrammarError(str(verdict))
        return verdict
