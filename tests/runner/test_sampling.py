"""Unit tests of kvserve.runner.sampling against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.messages.frontend_runner import SamplingParams
from kvserve.runner.sampling import (
    PenaltyState,
    Sampler,
    SampleRow,
    apply_penalties,
    filter_min_p,
    filter_top_k_top_p,
    make_generator,
    needs_penalties,
)

NEG = float("-inf")


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def test_greedy_is_argmax_and_fast_path() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.0, 4.5]])
    out = Sampler().sample(logits, [SampleRow(SamplingParams()), SampleRow(SamplingParams())])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_top_k_keeps_k_largest() -> None:
    x = torch.tensor([[1.0, 4.0, 2.0, 3.0], [1.0, 4.0, 2.0, 3.0]])
    got = filter_top_k_top_p(x, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert got[0].tolist() == [NEG, 4.0, NEG, 3.0]
    assert got[1].tolist() == [1.0, 4.0, 2.0, 3.0]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # probs 0.1 0.2 0.3 0.4: sorted mass before each = 0, .4, .7, .9
    x = _logits_of([0.1, 0.2, 0.3, 0.4]).repeat(3, 1)
    got = filter_top_k_top_p(x, torch.zeros(3, dtype=torch.long), torch.tensor([0.35, 0.6, 0.8]))
    kept = (got > NEG).tolist()
    assert kept[0] == [False, False, False, True]
    assert kept[1] == [False, False, True, True]
    assert kept[2] == [False, True, True, True]


def test_top_k_then_top_p_renormalizes() -> None:
    # top-k 2 leaves 0.3, 0.4 -> renormalized 3/7, 4/7; top-p 0.5 keeps only the 4/7 one
    x = _logits_of([0.1, 0.2, 0.3, 0.4])[None]
    got = filter_top_k_top_p(x, torch.tensor([2]), torch.tensor([0.5]))
    assert (got > NEG).tolist() == [[False, False, False, True]]


def test_min_p_zeroes_below_fraction_of_max() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    got = filter_min_p(probs, torch.tensor([0.2]))  # floor 0.1
    assert got.tolist() == [pytest.approx([0.5, 0.3, 0.15, 0.0])]


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    state = PenaltyState.create([0, 1], 5, "cpu", output_ids=[2, 2])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert needs_penalties(params) and not needs_penalties(SamplingParams())
    apply_penalties(logits, [0], [state], [params])
    # token0 (prompt) 2/2=1; token1 (prompt) -2*2=-4; token2 (output x2) 1/2 - 2*0.5 - 0.25;
    # token3, token4 unseen: unchanged
    assert logits[0].tolist() == pytest.approx([1.0, -4.0, -0.75, 0.5, 3.0])


def test_penalty_changes_greedy_choice_and_counts_update() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    state = PenaltyState.create([], 3, "cpu")
    row = SampleRow(SamplingParams(frequency_penalty=1.5), penalties=state)
    sampler = Sampler()
    assert sampler.sample(logits, [row]).token_ids == [0]
    state.add(0)
    assert sampler.sample(logits, [row]).token_ids == [1]  # 3 - 1.5 < 2
    assert logits[0].tolist() == [3.0, 2.0, 0.0]  # caller's logits untouched


def test_sampling_frequencies_match_distribution() -> None:
    n = 20000
    logits = _logits_of([0.1, 0.2, 0.3, 0.4]).repeat(n, 1)
    rows = [SampleRow(SamplingParams(temperature=1.0))] * n
    toks = torch.tensor(Sampler(seed=1).sample(logits, rows).token_ids)
    freq = torch.bincount(toks, minlength=4).float() / n
    assert freq.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.015)
    # temperature 0.5 squares the probabilities: 1,4,9,16 / 30
    rows = [SampleRow(SamplingParams(temperature=0.5))] * n
    toks = torch.tensor(Sampler(seed=2).sample(logits, rows).token_ids)
    freq = torch.bincount(toks, minlength=4).float() / n
    assert freq.tolist() == pytest.approx([1 / 30, 4 / 30, 9 / 30, 16 / 30], abs=0.015)
    # top-k 2 -> 3/7, 4/7 ; min-p 0.5 keeps tokens >= 0.2 -> 2/9, 3/9, 4/9
    rows = [SampleRow(SamplingParams(temperature=1.0, top_k=2))] * n
    freq = torch.bincount(torch.tensor(Sampler(seed=3).sample(logits, rows).token_ids), minlength=4) / n
    assert freq.tolist() == pytest.approx([0, 0, 3 / 7, 4 / 7], abs=0.015)
    rows = [SampleRow(SamplingParams(temperature=1.0, min_p=0.5))] * n
    freq = torch.bincount(torch.tensor(Sampler(seed=4).sample(logits, rows).token_ids), minlength=4) / n
    assert freq.tolist() == pytest.approx([0, 2 / 9, 3 / 9, 4 / 9], abs=0.015)


def _seeded_stream(seed: int, logits: torch.Tensor, others: int, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for a seeded request at row 0 with `others` unseeded rows."""
    gen = make_generator(seed, "cpu")
    sampler = Sampler(seed=others)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    out = []
    for _ in range(steps):
        rows = [SampleRow(params, generator=gen)] + [SampleRow(SamplingParams(temperature=1.0))] * others
        batch = torch.cat([logits[None], torch.randn(others, logits.shape[0])])
        out.append(sampler.sample(batch, rows).token_ids[0])
    return out


def test_seeded_request_is_independent_of_batch() -> None:
    logits = torch.randn(257, generator=torch.Generator().manual_seed(0))
    alone = _seeded_stream(1234, logits, others=0)
    assert _seeded_stream(1234, logits, others=5) == alone
    assert _seeded_stream(1234, logits, others=2) == alone
    assert _seeded_stream(99, logits, others=0) != alone


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 50.0], [7.0, 0.0, 0.0]])
    rows = [
        SampleRow(SamplingParams()),
        SampleRow(SamplingParams(temperature=1.0)),
        SampleRow(SamplingParams()),
    ]
    assert Sampler().sample(logits, rows).token_ids == [1, 2, 0]


def test_logprobs_are_raw_log_softmax_with_top_n() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, 0.0, 0.0, 1.0]])
    rows = [
        SampleRow(SamplingParams(logprobs=2, repetition_penalty=5.0),
                  penalties=PenaltyState.create([2], 4, "cpu")),
        SampleRow(SamplingParams()),
    ]
    out = Sampler().sample(logits, rows)
    # the penalty divides logit 3 by 5 -> token 1 wins, but logprobs are of the raw logits
    assert out.token_ids == [1, 3]
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp is not None and out.logprobs[1] is None
    assert lp.logprob == pytest.approx(float(ref[1]))
    assert lp.top_ids == [2, 1]
    assert lp.top_logprobs == pytest.approx([float(ref[2]), float(ref[1])])


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 rows, 1 sample rows"):
        Sampler().sample(torch.zeros(3, 4), [SampleRow(SamplingParams())])
