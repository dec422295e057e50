"""Logits processors (sampler.process_row) on hand-made rows: each does what its docstring says, exactly,
and reads nothing but the row and the sequence's own tokens. No model."""

from __future__ import annotations

import torch

from steadyserve.engine.sampler import process_row, sample
from steadyserve.engine.sequence import InvalidRequest, SamplingParams

import pytest

V = 32


def row() -> torch.Tensor:
    return torch.log_softmax(torch.randn(V, generator=torch.Generator().manual_seed(0)), dim=0)


def test_logit_bias_adds_to_the_named_tokens_only_and_can_force_one() -> None:
    r = row()
    p = SamplingParams(temperature=0, logit_bias={4: 100.0, 7: -2.5})
    out = process_row(r, p, [1, 2, 3], 3, set())
    assert out[4] == r[4] + 100.0 and out[7] == r[7] + torch.tensor(-2.5)
    mask = torch.ones(V, dtype=torch.bool)
    mask[[4, 7]] = False
    assert torch.equal(out[mask], r[mask]) and not torch.equal(out, r)
    assert sample(out, p, None) == 4


def test_presence_and_frequency_penalties_follow_openai_over_generated_tokens_only() -> None:
    r = row()
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    tokens = [9, 9, 9, 1, 2, 2]  # prompt [9, 9, 9]; generated [1, 2, 2]
    out = process_row(r, p, tokens, 3, set())
    assert out[1] == r[1] - torch.tensor(0.25 * 1 + 0.5)
    assert out[2] == r[2] - torch.tensor(0.25 * 2 + 0.5)
    assert out[9] == r[9]  # a prompt token is not penalized by presence/frequency
    assert out[5] == r[5]


def test_repetition_penalty_multiplies_prompt_and_generated_tokens() -> None:
    r = row()
    out = process_row(r, SamplingParams(repetition_penalty=1.5), [9, 1], 1, set())
    assert out[9] == r[9] * 1.5 and out[1] == r[1] * 1.5 and out[2] == r[2]
    assert out[9] < r[9]  # log-probabilities are negative: > 1 makes a repeat less likely


def test_min_tokens_masks_end_tokens_until_enough_are_generated() -> None:
    r = row()
    r[3] = 0.0  # the end token is the likeliest
    p = SamplingParams(temperature=0, min_tokens=2)
    early = process_row(r, p, [5, 6, 7], 2, {3})  # one generated
    assert early[3] == float("-inf") and sample(early, p, None) != 3
    late = process_row(r, p, [5, 6, 7, 8], 2, {3})  # two generated
    assert torch.equal(late, r) and sample(late, p, None) == 3


def test_process_row_leaves_the_models_row_untouched() -> None:
    r = row()
    before = r.clone()
    process_row(r, SamplingParams(logit_bias={1: 5.0}, repetition_penalty=2.0, presence_penalty=1.0), [1, 2], 1, {0})
    assert torch.equal(r, before)


@pytest.mark.parametrize("kw,param", [({"presence_penalty": 2.5}, "presence_penalty"),
                                      ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                                      ({"repetition_penalty": 0.0}, "repetition_penalty"),
                                      ({"logit_bias": {1: 101.0}}, "logit_bias"),
                                      ({"min_tokens": 17}, "min_tokens")])
def test_out_of_range_processors_are_refused_by_name(kw, param) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == param


def test_draw_follows_the_distribution_never_draws_a_zero_and_repeats_by_seed() -> None:
    """The seeded draw (inverse CDF, one uniform per token): right frequencies, impossible tokens never drawn,
    the same tokens for the same seed, and other tokens for another seed."""
    from steadyserve.engine.sampler import draw, make_generator

    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    g = make_generator(7, torch.device("cpu"))
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(20000)]), minlength=5).double() / 20000
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts, probs.double(), atol=0.015), counts
    seq = lambda seed: [draw(probs, g) for g in [make_generator(seed, torch.device("cpu"))] for _ in range(64)]  # noqa: E731
    assert seq(3) == seq(3) and seq(3) != seq(4)
    one_hot = torch.zeros(49152)
    one_hot[49151] = 1.0  # the last token: the running sum reaches the total only there
    assert draw(one_hot, g) == 49151
