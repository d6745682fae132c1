"""Unit tests of kvserve.runner.sampling against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.messages.frontend_runner import GREEDY_TEMPERATURE, SamplingParams
from kvserve.runner.sampling import (
    FLOAT32_MAX,
    PenaltyState,
    Sampler,
    SampleRow,
    apply_penalties,
    draw_seed,
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


def test_a_plainly_greedy_step_is_read_in_one_pass_by_the_given_argmax() -> None:
    from kvserve.kernels import native

    if not native.available():
        pytest.skip("no native kernels (no C compiler)")
    seen: list[torch.dtype] = []

    def argmax(logits: torch.Tensor):
        seen.append(logits.dtype)
        return native.row_argmax(logits)

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=g).bfloat16()
    logits[4, 17] = float("nan")
    greedy = [SampleRow(SamplingParams()) for _ in range(6)]
    out = Sampler(argmax=argmax).sample(logits, greedy)
    reference = Sampler().sample(logits.float(), greedy)  # torch's max and min
    assert seen == [torch.bfloat16]
    assert out == reference
    assert out.nonfinite == [False] * 4 + [True, False] and out.token_ids[4] == -1
    # a row that asks for more than its greedy token (logprobs, penalties, a temperature)
    # sends the whole step down the float32 path, which widens the bfloat16 logits itself
    for odd in (SampleRow(SamplingParams(logprobs=1)), SampleRow(SamplingParams(temperature=0.5)),
                SampleRow(SamplingParams(), penalties=PenaltyState.create([1], 5000, "cpu"))):
        rows = [*greedy[:5], odd]
        seen.clear()
        mixed = Sampler(seed=5, argmax=argmax).sample(logits, rows)
        assert seen == []
        assert mixed.token_ids[:5] == reference.token_ids[:5]
        assert mixed == Sampler(seed=5).sample(logits.float(), rows)


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


def _penalized_by_hand(logits: list[float], prompt: set[int], counts: dict[int, int], rep: float,
                       presence: float, frequency: float) -> list[float]:
    """The penalty formulas written out token by token (transformers / OpenAI semantics)."""
    out = []
    for tok, x in enumerate(logits):
        n = counts.get(tok, 0)
        if tok in prompt or n:
            x = x / rep if x > 0 else x * rep
        out.append(x - frequency * n - (presence if n else 0.0))
    return out


def test_penalties_shape_the_sampled_distribution_as_hand_computed() -> None:
    """Penalties, then temperature, then sampling: the frequencies are those of the
    softmax of the hand-penalized logits (and far from the unpenalized ones)."""
    raw = [2.0, 1.0, -1.0, 0.5, 0.0]
    prompt, generated = [1], [0, 0, 2]
    rep, presence, frequency, temp = 1.5, 0.3, 0.2, 0.8
    want = _penalized_by_hand(raw, set(prompt), {0: 2, 2: 1}, rep, presence, frequency)
    assert want == pytest.approx([2 / 1.5 - 0.4 - 0.3, 1 / 1.5, -1.5 - 0.2 - 0.3, 0.5, 0.0])
    probs = torch.tensor(want).div(temp).softmax(-1).tolist()
    unpenalized = torch.tensor(raw).div(temp).softmax(-1).tolist()
    assert abs(probs[0] - unpenalized[0]) > 0.2  # the check below can tell them apart

    n = 20000
    state = PenaltyState.create(prompt, len(raw), "cpu", output_ids=generated)
    params = SamplingParams(temperature=temp, repetition_penalty=rep, presence_penalty=presence,
                            frequency_penalty=frequency)
    rows = [SampleRow(params, penalties=state)] * n
    toks = torch.tensor(Sampler(seed=11).sample(torch.tensor(raw).repeat(n, 1), rows).token_ids)
    freq = (torch.bincount(toks, minlength=len(raw)).float() / n).tolist()
    assert freq == pytest.approx(probs, abs=0.015)


def test_penalties_act_on_the_right_tokens_greedily() -> None:
    """Greedy rows pick the argmax of the penalized logits: each penalty alone flips the
    choice (or keeps it) the way the formulas say, and only for the tokens it concerns."""
    row = [3.0, 2.5, 2.0, -0.5]
    negative = [-1.0, -1.2, -3.0, -4.0]
    cases = [  # (logits, prompt, generated, params, expected token)
        (row, [0], [], SamplingParams(repetition_penalty=1.5), 1),  # 3/1.5 = 2 < 2.5
        (row, [], [0], SamplingParams(presence_penalty=0.75), 1),  # 3 - 0.75 < 2.5
        (row, [], [0, 0], SamplingParams(frequency_penalty=0.4), 1),  # 3 - 0.8 < 2.5
        (row, [], [0], SamplingParams(frequency_penalty=0.4), 0),  # 3 - 0.4 > 2.5
        (row, [], [0, 0, 0], SamplingParams(frequency_penalty=0.1), 0),  # linear in the count: 3 - 0.3
        (row, [1], [0], SamplingParams(presence_penalty=0.75), 1),  # not on prompt tokens: 2.5 > 3 - 0.75
        (negative, [0], [], SamplingParams(repetition_penalty=1.5), 1),  # a negative logit is multiplied
        (row, [3], [], SamplingParams(repetition_penalty=20.0), 0),  # -0.5 * 20: a negative logit only drops
        (row, [], [3], SamplingParams(frequency_penalty=-10.0), 3),  # a negative penalty encourages
    ]
    for logits, prompt, generated, params, want in cases:
        state = PenaltyState.create(prompt, 4, "cpu", output_ids=generated)
        by_hand = _penalized_by_hand(logits, set(prompt), {t: generated.count(t) for t in generated},
                                     params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        assert int(torch.tensor(by_hand).argmax()) == want, (logits, prompt, generated, params)
        got = Sampler().sample(torch.tensor([logits]), [SampleRow(params, penalties=state)]).token_ids
        assert got == [want], (logits, prompt, generated, params)


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
    sampler = Sampler(seed=others)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    out = []
    for index in range(steps):
        rows = [SampleRow(params, seed=seed, index=index)] + [SampleRow(SamplingParams(temperature=1.0))] * others
        batch = torch.cat([logits[None], torch.randn(others, logits.shape[0])])
        out.append(sampler.sample(batch, rows).token_ids[0])
    return out


def test_seeded_request_is_independent_of_batch() -> None:
    logits = torch.randn(257, generator=torch.Generator().manual_seed(0))
    alone = _seeded_stream(1234, logits, others=0)
    assert _seeded_stream(1234, logits, others=5) == alone
    assert _seeded_stream(1234, logits, others=2) == alone
    assert _seeded_stream(99, logits, others=0) != alone


def test_a_seeded_draw_is_a_function_of_seed_and_position_alone() -> None:
    """The draw for output token n is the same whatever was drawn before it, on whichever
    sampler: a request preempted and recomputed, or resumed on another runner, draws again
    what it drew; and it is another draw at another position."""
    logits = torch.zeros(1, 1000)  # uniform: the token is the draw's argmin, 1 in 1000
    params = SamplingParams(temperature=1.0, seed=42)
    stream = _seeded_stream(42, logits[0], others=0, steps=12)
    fresh = Sampler(seed=3)
    for _ in range(5):  # other draws first: the shared generator and other seeds
        fresh.sample(logits, [SampleRow(SamplingParams(temperature=1.0))])
        fresh.sample(logits, [SampleRow(SamplingParams(temperature=1.0, seed=7), seed=7, index=0)])
    later = [fresh.sample(logits, [SampleRow(params, seed=42, index=i)]).token_ids[0] for i in (11, 4, 0)]
    assert later == [stream[11], stream[4], stream[0]]
    assert len(set(stream)) > 8, stream  # 12 positions, 12 draws: not one draw repeated


def test_draw_seeds_differ_across_seeds_and_positions() -> None:
    seeds = {draw_seed(seed, index) for seed in (0, 1, 2, 2**64 - 1, -(2**63)) for index in range(50)}
    assert len(seeds) == 250
    assert draw_seed(-1, 3) == draw_seed(2**64 - 1, 3)  # the same 64-bit seed, as torch takes it
    with pytest.raises(ValueError, match="seed 18446744073709551616 is outside"):
        draw_seed(2**64, 0)


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


def test_tiny_temperature_is_greedy() -> None:
    """Below GREEDY_TEMPERATURE a row takes the argmax (1e-40 once overflowed every logit
    to inf, NaN after the softmax, and returned token 0 forever)."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]]).repeat(8, 1)
    for temp in (1e-40, 1e-30, 1e-6, GREEDY_TEMPERATURE / 2):
        rows = [SampleRow(SamplingParams(temperature=temp, top_p=0.5, min_p=0.1))] * 8
        assert Sampler().sample(logits, rows).token_ids == [2] * 8


def test_small_temperature_on_huge_logits_stays_finite() -> None:
    """Just above the greedy threshold, logits near the float32 limit would overflow when
    divided by the temperature; the sampler shifts them first and picks the maximum."""
    logits = torch.tensor([[3e38, -3e38, 3.3e38, 1e38]]).repeat(16, 1)
    rows = [SampleRow(SamplingParams(temperature=GREEDY_TEMPERATURE * 2, top_k=3))] * 16
    out = Sampler().sample(logits, rows)
    assert out.token_ids == [2] * 16 and not any(out.nonfinite)


def test_nonfinite_rows_are_reported_not_sampled() -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [nan, 0.0, 1.0],
        [1.0, 2.0, 3.0],
        [inf, 0.0, 0.0],
        [0.0, -inf, 1.0],
        [0.5, 4.0, 0.0],
    ])
    before = logits.clone()
    rows = [
        SampleRow(SamplingParams(temperature=1.0, logprobs=2)),
        SampleRow(SamplingParams(logprobs=2)),
        SampleRow(SamplingParams()),
        SampleRow(SamplingParams(temperature=0.7), penalties=PenaltyState.create([2], 3, "cpu")),
        SampleRow(SamplingParams(temperature=1e-3, logprobs=1)),
    ]
    out = Sampler().sample(logits, rows)
    assert out.nonfinite == [True, False, True, True, False]
    assert out.token_ids == [-1, 2, -1, -1, 1]
    assert out.logprobs[0] is None and out.logprobs[2] is None and out.logprobs[3] is None
    good = out.logprobs[1]
    assert good is not None and good.top_ids == [2, 1]
    assert good.logprob == pytest.approx(float(torch.log_softmax(before[1], -1)[2]))
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())


def test_unseeded_draws_fresh_entropy_and_a_sampler_seed_repeats() -> None:
    logits = torch.zeros(1, 1000)  # uniform: 25 equal draws from two generators never happen
    row = [SampleRow(SamplingParams(temperature=1.0))]

    def stream(sampler: Sampler) -> list[int]:
        return [sampler.sample(logits, row).token_ids[0] for _ in range(25)]

    assert stream(Sampler()) != stream(Sampler())
    assert stream(Sampler(seed=7)) == stream(Sampler(seed=7))
    assert stream(Sampler(seed=7)) != stream(Sampler(seed=8))


def test_seed_range_is_torchs() -> None:
    for seed in (-(2**63), 0, 2**64 - 1):
        make_generator(seed, "cpu")
    for seed in (-(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match=f"seed {seed} is outside"):
            make_generator(seed, "cpu")


def test_huge_penalties_give_huge_logits_not_nan() -> None:
    """Finite penalties of any size: the penalized logits are clamped to float32, so the
    row still samples the token the penalties favour."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    state = PenaltyState.create([0], 4, "cpu", output_ids=[2, 2])
    for params in (
        SamplingParams(presence_penalty=-1e300),  # token 2, generated, pushed to +max
        SamplingParams(frequency_penalty=-1e300, repetition_penalty=1e-300),
        SamplingParams(temperature=1.0, presence_penalty=-1e300, frequency_penalty=1e30),
        SamplingParams(temperature=3.0, frequency_penalty=-1e300),
    ):
        out = Sampler().sample(logits, [SampleRow(params, penalties=state)])
        assert out.token_ids == [2], params
    penalized = logits.clone()
    apply_penalties(penalized, [0], [state], [SamplingParams(repetition_penalty=1e300, frequency_penalty=1e300)])
    assert penalized.isfinite().all()
    # token 0 (prompt): 1 / max; token 2 (generated twice): -1 * max - 2 * max, clamped
    assert penalized[0].tolist() == pytest.approx([1 / FLOAT32_MAX, 0.0, -FLOAT32_MAX, 2.0], abs=1e-37)
