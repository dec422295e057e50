"""Top-p at a 128k vocabulary (sampler.nucleus): the same kept tokens, bit for bit, as the torch.sort code it
replaced (kept as sampler.nucleus_by_order, which nucleus falls back on), and so the same sampled tokens. No model.

The rows are what the sampler sees: log-probabilities divided by a temperature, flat (a random model's) and peaky (a
trained model's), after top-k (a tail of -inf), with ties placed at the nucleus boundary (where only the sort's
order of equal values decides, so the fallback must run) and a row whose likeliest token holds all the mass.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from steadyserve.engine import sampler
from steadyserve.engine.sampler import descending, make_generator, nucleus, nucleus_by_order, sample
from steadyserve.engine.sequence import SamplingParams

V = 128256  # Llama 3's vocabulary


@cache
def rows() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for spread in (0.05, 1.0, 4.0):  # a random model's near-flat row .. a trained model's peaky one
        out.append((f"spread{spread}", torch.log_softmax(torch.randn(V, generator=g) * spread, 0) / 0.8))
    peaky = torch.log_softmax(torch.randn(V, generator=g) * 3.0, 0)
    out.append(("top-k 50", peaky.masked_fill(peaky < torch.topk(peaky, 50).values[-1], float("-inf"))))
    coarse = torch.log_softmax((torch.randn(V, generator=g) * 8).round() / 4, 0)  # many equal values
    out.append(("coarse", coarse))
    one = torch.full((V,), float("-inf"))
    one[7] = 0.0  # all the mass on one token (its log-probability 0.0)
    out.append(("one token", one))
    return out


TOP_P = (0.05, 0.9, 0.999)
NAMES = ["spread0.05", "spread1.0", "spread4.0", "top-k 50", "coarse", "one token"]


@pytest.mark.parametrize("i", range(len(NAMES)), ids=NAMES)
def test_nucleus_keeps_the_tokens_the_sort_by_order_kept(i):
    name, row = rows()[i]
    for top_p in TOP_P:
        assert torch.equal(nucleus(row, top_p), nucleus_by_order(row, top_p)), (name, top_p)


def test_a_tie_at_the_boundary_takes_the_order_path(monkeypatch):
    """Two equal values straddling the boundary: the fast path cannot tell which one the sort's order keeps, so
    the former code answers; and a row without such a tie never runs it."""
    row = torch.log_softmax(torch.tensor([4.0, 3.0, 3.0, 1.0] + [-20.0] * 60), 0)
    p0 = float(torch.softmax(row, 0)[0])
    calls = []
    order = sampler.nucleus_by_order
    monkeypatch.setattr(sampler, "nucleus_by_order", lambda *a: calls.append(a) or order(*a))
    top_p = p0 + 0.01  # crosses inside the pair of 3.0s
    assert torch.equal(nucleus(row, top_p), order(row, top_p)) and len(calls) == 1
    calls.clear()
    nucleus(rows()[1][1], 0.9)
    assert not calls


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.95, seed=1),
                                    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=2)], ids=["p", "k+p"])
def test_sampled_tokens_are_the_former_samplers(params, monkeypatch):
    """Three draws per row with the request's generator, through sample(): the tokens of the former code."""
    def draws():
        g = make_generator(params.seed, torch.device("cpu"))
        return [sample(r, params, g) for _, r in rows()[:4] for _ in range(3)]

    ours = draws()
    monkeypatch.setattr(sampler, "nucleus", sampler.nucleus_by_order)
    assert ours == draws()


def test_descending_gives_the_values_torch_sort_gives():
    """Every sign, zero, subnormal and extreme, and a row: the values of torch.sort(descending=True) (where -0.0 and
    0.0 may change places: they are equal to softmax and to every comparison)."""
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 3.4e38, -3.4e38, -1.0, 1.0, -1.0, 2.5])
    for x in (special, rows()[1][1]):
        ref = torch.sort(x, descending=True).values
        assert torch.equal(descending(x), ref)
