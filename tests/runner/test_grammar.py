"""The runner's constraint machinery on a byte-level tokenizer: matchers compiled once per
grammar text and handed out as independent copies, the masks a fill computes, the sampler
applying them to their own rows only, and accept's verdicts."""

from __future__ import annotations

import llguidance
import pytest
import torch
from tokenizers import Tokenizer

from kvserve.messages.frontend_runner import SamplingParams
from kvserve.runner import grammar as grammar_mod
from kvserve.runner.grammar import Constrainer
from kvserve.runner.sampling import Sampler, SampleRow, apply_masks
from kvserve.tools.tinymodel import BYTE_VOCAB, VOCAB_SIZE, write_tokenizer

EOS = BYTE_VOCAB + 1


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return Tokenizer.from_file(str(d / "tokenizer.json"))


@pytest.fixture
def constrainer(tok: Tokenizer) -> Constrainer:
    return Constrainer(tok.to_str, VOCAB_SIZE, [EOS])


def _regex(pattern: str) -> str:
    return llguidance.grammar_from("regex", pattern)


def _id(tok: Tokenizer, ch: str) -> int:
    return tok.encode(ch, add_special_tokens=False).ids[0]


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(VOCAB_SIZE) if (words[t // 32] >> (t % 32)) & 1}


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher(tok: Tokenizer, constrainer: Constrainer,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(grammar_mod.llguidance, "LLMatcher", lambda *a, **kw: built.append(a[1]) or real(*a, **kw))
    g = _regex("ab")
    one, two = constrainer.matcher(g), constrainer.matcher(g)
    assert built == [g]  # the second is a copy of the kept one
    assert constrainer.accept(one, _id(tok, "a")) == (False, "")
    assert constrainer.accept(two, _id(tok, "b"))[1]  # two is still at the start: "b" is refused
    assert constrainer.accept(one, _id(tok, "b")) == (True, "")
    three = constrainer.matcher(g)  # the kept matcher was not advanced by its copies
    assert constrainer.accept(three, _id(tok, "a")) == (False, "")


def test_the_least_recently_used_grammar_is_compiled_again(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_mod, "MATCHERS_KEPT", 2)
    constrainer = Constrainer(tok.to_str, VOCAB_SIZE, [EOS])  # keeps MATCHERS_KEPT grammars
    built = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(grammar_mod.llguidance, "LLMatcher", lambda *a, **kw: built.append(a[1]) or real(*a, **kw))
    a, b, c = _regex("a"), _regex("b"), _regex("c")
    for g in (a, b, a, c, a, b):  # c pushes out b (a was used after it)
        constrainer.matcher(g)
    assert built == [a, b, c, b]


def test_a_grammar_that_does_not_compile_is_a_value_error(constrainer: Constrainer) -> None:
    with pytest.raises(ValueError):
        constrainer.matcher(llguidance.grammar_from("lark", "start: nope"))


def test_masks_allow_what_the_grammar_allows_and_touch_only_their_rows(tok: Tokenizer,
                                                                      constrainer: Constrainer) -> None:
    ab, digit = constrainer.matcher(_regex("ab")), constrainer.matcher(_regex("[0-9]"))
    rows, bitmask = constrainer.fill([0, 2], [ab, digit]).result()
    assert rows == [0, 2]
    assert _allowed(bitmask, 0) == {_id(tok, "a")}
    assert _allowed(bitmask, 1) == {_id(tok, str(d)) for d in range(10)}
    logits = torch.randn(3, VOCAB_SIZE)
    masked = logits.clone()
    apply_masks(masked, rows, bitmask)
    assert torch.equal(masked[1], logits[1])  # the unconstrained row keeps its numbers
    for row, mrow in ((0, 0), (2, 1)):
        keep = sorted(_allowed(bitmask, mrow))
        assert torch.equal(masked[row, keep], logits[row, keep])
        banned = torch.ones(VOCAB_SIZE, dtype=torch.bool)
        banned[keep] = False
        assert bool(torch.isneginf(masked[row, banned]).all())
    sampled = [SampleRow(SamplingParams(temperature=1.0), seed=1, matcher=ab), SampleRow(SamplingParams()),
               SampleRow(SamplingParams(temperature=1.0), seed=2, matcher=digit)]
    drawn = set()
    for index in range(20):  # a seeded row draws anew at each output index
        for r in (sampled[0], sampled[2]):
            r.index = index
        tokens = Sampler().sample(logits, sampled, masks=(rows, bitmask)).token_ids
        assert tokens[0] == _id(tok, "a") and tokens[2] in _allowed(bitmask, 1)
        assert tokens[1] == int(logits[1].argmax())  # greedy, unmasked
        drawn.add(tokens[2])
    assert len(drawn) > 1  # sampled among the digits, not pinned to one


def test_a_row_whose_mask_allows_nothing_is_named_and_left_unmasked() -> None:
    from concurrent.futures import Future

    from kvserve.runner.grammar import Fill

    done: Future = Future()
    done.set_result(0.001)
    bitmask = torch.zeros(2, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
    bitmask[1, 0] = 1  # row 1 allows token 0
    fill = Fill([4, 7], done, bitmask)
    rows, got = fill.result()
    assert rows == [4, 7] and fill.empty == {4}
    assert bool((got[0] == -1).all()) and got[1, 0] == 1 and bool((got[1, 1:] == 0).all())
