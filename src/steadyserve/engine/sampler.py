"""Token choice and logprobs, one row at a time.

Each request has its own torch.Generator, so a seeded request draws the same
random numbers whatever else runs in its steps. All work here is on the
request's own (V,) row of log-probabilities, so it is batch-invariant as long
as the row is.
"""

from __future__ import annotations

import torch

from .sequence import SamplingParams, TokenLogprob


class NumericalError(RuntimeError):
    """The model produced NaN for this request; the request fails alone."""


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           argmax: int | None = None, has_nan: bool | None = None) -> int:
    """row: (V,) float32 log-probabilities. Returns the chosen token id.

    `argmax` and `has_nan`, when the caller computed them for a whole step at
    once, must equal `row.argmax()` (first maximum) and `row.isnan().any()`.
    """
    if has_nan if has_nan is not None else bool(torch.isnan(row).any()):
        raise NumericalError("the model produced NaN log-probabilities")
    if params.greedy:
        return argmax if argmax is not None else int(torch.argmax(row).item())
    logits = row / params.temperature
    if params.top_k and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprob(row: torch.Tensor, token_id: int, num_top: int | None) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if num_top:
        values, indices = torch.topk(row, num_top)
        top = list(zip(indices.tolist(), values.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(row[token_id].item()), top=top)
