"""xgrammar against llguidance on kvserve's tokenizer: which grammar library constrains decoding.

For each of a few grammars (JSON schemas of growing size, any JSON object, a regex, a choice,
an EBNF grammar) it measures, per library: the time until a new request's first mask is ready
(compile, cold: a fresh compiler each time, plus the matcher and its first mask: llguidance
builds lazily), and the time to compute one row's token mask at every step of a valid output (the output's
own tokens, fed back one by one; each must be allowed by the mask, which checks the two
libraries agree with the tokenizer). Then the batch case: 32 rows each at its own position of
the largest schema's output, one mask computation for all of them per step (llguidance's
parallel executor, xgrammar's BatchGrammarMatcher), per row per step. Also the import cost and
whether the library pulls in torch or transformers (the frontend, which must compile a schema to
refuse it with a 400, imports neither).

    python bench/grammar_libs.py [--model PATH] [--json OUT] [--general-slices]

Prints the CPU flags beside the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "customer", "items", "status", "notes"],
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "tier"],
                     "properties": {"name": {"type": "string", "maxLength": 40},
                                    "email": {"type": "string", "format": "email"},
                                    "tier": {"enum": ["free", "pro", "enterprise"]}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                           "price": {"type": "number", "minimum": 0}}}},
        "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
}
BOUNDED = {  # bench/structured_cost.py's: strings of bounded length
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
    "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer", "minimum": 0},
                   "city": {"type": "string", "maxLength": 32},
                   "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 24}}},
}
CASES = [
    ("schema:person", "json", json.dumps(PERSON), '{"name": "Ada Lovelace", "age": 36}'),
    ("schema:order", "json", json.dumps(ORDER),
     '{"id": "ABC-1234", "customer": {"name": "Grace Hopper", "email": "grace@navy.mil", "tier": "pro"}, '
     '"items": [{"sku": "kv-01", "qty": 2, "price": 19.5}, {"sku": "kv-02", "qty": 1, "price": 3}], '
     '"status": "paid", "notes": null}'),
    ("schema:bounded", "json", json.dumps(BOUNDED),
     '{"name": "Alice Johnson", "age": 34, "city": "Portland", "hobbies": ["hiking", "painting", "chess"]}'),
    ("json_object", "json", json.dumps({"type": "object"}),
     '{"answer": [1, 2, {"deep": true}], "text": "hello world"}'),
    ("regex", "regex", r"\d{3}-\d{3}-\d{4}", "555-867-5309"),
    ("choice", "choice", json.dumps(["positive", "negative", "neutral"]), "negative"),
    ("ebnf", "grammar", 'root ::= "SELECT " col (", " col)* " FROM " tbl\ncol ::= [a-z]+\ntbl ::= [a-z]+',
     "SELECT name, age FROM people"),
]


def cpu_flags() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{model}; {' '.join(keep)}"


def import_cost(module: str) -> dict:
    code = (f"import sys, time; t = time.perf_counter(); import {module}; d = time.perf_counter() - t; "
            "print(d, 'torch' in sys.modules, 'transformers' in sys.modules)")
    d, torch, tf = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True).stdout.split()
    return {"import_s": round(float(d), 3), "imports_torch": torch == "True", "imports_transformers": tf == "True"}


class LLG:
    name = "llguidance"

    def __init__(self, tok_json: Path, vocab: int, eos: list[int], general: bool = False) -> None:
        import llguidance
        import llguidance.torch
        self.llg = llguidance
        self.lt = llguidance.torch
        from kvserve.model.grammars import llg_tokenizer

        t = time.perf_counter()
        self.tok = llg_tokenizer(tok_json.read_text(), vocab, eos)
        if general:  # llguidance's default token slices instead of the JSON ones kvserve uses
            self.tok = self.tok.with_slices(llguidance.LLTokenizer.general_slices())
        self.setup_s = time.perf_counter() - t
        self.executor = llguidance.LLExecutor()
        self.vocab = vocab

    def compile(self, kind: str, text: str):
        g = self.llg.grammar_from({"json": "json_schema", "grammar": "grammar"}.get(kind, kind), text)
        err = self.llg.LLMatcher.validate_grammar(g, self.tok)
        if err:
            raise ValueError(err)
        return g

    def matcher(self, grammar):
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, rows: int):
        return self.lt.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, mask, row: int = 0) -> None:
        self.lt.fill_next_token_bitmask(m, mask, row)

    def fill_batch(self, ms, mask) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def accept(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()


class XGR:
    name = "xgrammar"

    def __init__(self, tok_json: Path, vocab: int, eos: list[int], general: bool = False) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgrammar
        t = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_json))
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.setup_s = time.perf_counter() - t
        self.vocab = vocab
        self.batch = None

    def compile(self, kind: str, text: str):
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))  # kvserve's layout
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(text)))
        return c.compile_grammar(text)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, mask, row: int = 0) -> None:
        m.fill_next_token_bitmask(mask, row)

    def fill_batch(self, ms, mask) -> None:
        if self.batch is None:
            self.batch = self.xgr.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m, token: int) -> None:
        assert m.accept_token(token), f"token {token} refused"


def allowed(mask, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def walk(lib, grammar, ids: list[int]) -> tuple[float, list[float]]:
    """The time (s) to a matcher's first mask, and the mask time at each step of `ids`,
    checking that every token is allowed."""
    t = time.perf_counter()
    m, mask = lib.matcher(grammar), lib.bitmask(1)
    lib.fill(m, mask)
    first, times = time.perf_counter() - t, []
    for tid in ids:
        t = time.perf_counter()
        lib.fill(m, mask)
        times.append(time.perf_counter() - t)
        assert allowed(mask, 0, tid), f"{lib.name}: token {tid} masked out"
        lib.accept(m, tid)
    return first, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model file or directory (default: the embedded model)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5, help="compiles (and walks) per grammar")
    ap.add_argument("--json", default=None)
    ap.add_argument("--general-slices", action="store_true",
                    help="llguidance with its default token slices (kvserve uses the JSON ones)")
    args = ap.parse_args()

    from kvserve.model import tokenizer_cache
    from kvserve.model.files import resolve_model
    from kvserve.model.tokenizer import load_model_tokenizer

    path = resolve_model(args.model)
    tok = load_model_tokenizer(args.model)
    tok_json = (path if path.is_dir() else tokenizer_cache.ensure_cached(path)) / "tokenizer.json"
    print(f"# CPU: {cpu_flags()}")
    print(f"# tokenizer {tok.name}: vocab {tok.vocab_size}; rows in the batch case {args.rows}")
    result: dict = {"cpu": cpu_flags(), "tokenizer": tok.name, "vocab": tok.vocab_size, "libs": {}}
    for cls, module in ((LLG, "llguidance"), (XGR, "xgrammar")):
        lib = cls(tok_json, tok.vocab_size, tok.eos_token_ids, args.general_slices)
        entry = {**import_cost(module), "tokenizer_setup_s": round(lib.setup_s, 3), "cases": {}}
        print(f"\n## {lib.name}: import {entry['import_s']} s (torch {entry['imports_torch']}, transformers "
              f"{entry['imports_transformers']}), tokenizer setup {lib.setup_s:.3f} s")
        print(f"{'grammar':16} {'ready ms':>11} {'tokens':>7} {'mask us p50':>12} {'mask us p99':>12} {'max':>9}")
        for label, kind, text, sample in CASES:
            compiles, masks = [], []
            for _ in range(args.repeat):
                t = time.perf_counter()
                grammar = lib.compile(kind, text)
                compiled = time.perf_counter() - t
                first, steps = walk(lib, grammar, tok.encode(sample))
                compiles.append(compiled + first)
                masks += steps
            masks.sort()
            row = {"ready_ms": round(statistics.median(compiles) * 1e3, 2), "tokens": len(tok.encode(sample)),
                   "mask_us_p50": round(masks[len(masks) // 2] * 1e6, 1),
                   "mask_us_p99": round(masks[int(len(masks) * 0.99)] * 1e6, 1),
                   "mask_us_max": round(masks[-1] * 1e6, 1)}
            entry["cases"][label] = row
            print(f"{label:16} {row['ready_ms']:>11} {row['tokens']:>7} {row['mask_us_p50']:>12} "
                  f"{row['mask_us_p99']:>12} {row['mask_us_max']:>9}")
        # the batch case: rows at staggered positions of the order schema's output
        _, kind, text, sample = CASES[1]
        grammar, ids = lib.compile(kind, text), tok.encode(sample)
        ms = [lib.matcher(grammar) for _ in range(args.rows)]
        for i, m in enumerate(ms):
            for tid in ids[: i % (len(ids) - 1)]:
                lib.accept(m, tid)
        mask, steps = lib.bitmask(args.rows), []
        for _ in range(20):
            t = time.perf_counter()
            lib.fill_batch(ms, mask)
            steps.append(time.perf_counter() - t)
        per_row = statistics.median(steps) / args.rows * 1e6
        entry["batch"] = {"rows": args.rows, "step_ms_p50": round(statistics.median(steps) * 1e3, 3),
                          "per_row_us": round(per_row, 1)}
        print(f"batch of {args.rows} (order schema): {entry['batch']['step_ms_p50']} ms a step, "
              f"{per_row:.1f} us a row")
        result["libs"][lib.name] = entry
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
