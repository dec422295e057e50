"""An embedding request's pooled vector, folded from the hidden rows its prefill chunks compute.

An embedding is a prefill-only sequence (Request.embed): each step hands the engine the final-norm hidden
rows of the chunk it computed (SeqResult.hidden_rows), and `PoolState` folds them in position order. The
rows themselves are batch-invariant (the same kernels as logprobs), so the pooled vector is too provided the
fold is: it never depends on how the prompt was split into chunks or how many threads run. So `last` keeps
the last position's row as it is, and `mean` adds the rows one at a time in float64, in position order, with
elementwise adds only (no reduction whose order a chunk size or a thread count could change), then divides
once. Rows recomputed after a preemption are skipped, as prompt logprobs are (they are the same bits).

`finish_vector` (truncation to `dimensions`, L2 normalisation) is the one place a pooled vector becomes what
a client receives, for every transport; it is exact-order Python arithmetic, so it is invariant as well.
"""

from __future__ import annotations

import math

import torch


class PoolState:
    """One embedding sequence's fold of its prompt's hidden rows (owned by the engine thread)."""

    def __init__(self, mode: str, num_prompt_tokens: int) -> None:
        self.mode = mode  # last | mean (models/pooling.py)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_rows = 0  # mean: positions 0 .. num_rows - 1 folded so far (every one is computed: no cache hits)
        self._sum: torch.Tensor | None = None  # mean: float64 running sum, in position order
        self._last: torch.Tensor | None = None  # last: the last position's row (float32)

    def add(self, rows: torch.Tensor, first_pos: int) -> None:
        """Fold the (n, hidden) rows of positions first_pos .. first_pos + n - 1."""
        if self.mode == "last":  # only the last position counts; the chunks before it may be cache hits
            last = self.num_prompt_tokens - 1
            if self._last is None and first_pos <= last < first_pos + rows.shape[0]:
                self._last = rows[last - first_pos].float().clone()
            return
        if first_pos > self.num_rows:  # rows never computed (a prefix-cache hit): fail the request, never hang it
            raise RuntimeError(f"mean pooling lacks the hidden rows of positions {self.num_rows}..{first_pos - 1}")
        for i in range(rows.shape[0]):
            if first_pos + i < self.num_rows:  # recomputed after a preemption: already folded, the same bits
                continue
            self.num_rows += 1
            row = rows[i].to(torch.float64)
            self._sum = row.clone() if self._sum is None else self._sum.add_(row)

    @property
    def done(self) -> bool:
        return self._last is not None if self.mode == "last" else self.num_rows >= self.num_prompt_tokens

    def vector(self) -> list[float]:
        """The pooled float32 vector (as Python floats, exact), once every position is folded."""
        assert self.done, (self.num_rows, self.num_prompt_tokens)
        if self.mode == "mean":
            assert self._sum is not None
            return (self._sum / self.num_rows).to(torch.float32).tolist()
        assert self._last is not None
        return self._last.tolist()


def finish_vector(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """A pooled vector as a client gets it: its first `dimensions` components (all when None), L2-normalised
    when the model's embedding is (normalised after truncation, so a shortened vector is a unit vector too,
    as OpenAI's `dimensions` gives it). float32 values, computed in a fixed order (math.fsum is exact)."""
    v = vector if dimensions is None else vector[:dimensions]
    if not normalize:
        return v
    norm = math.sqrt(math.fsum(x * x for x in v))
    scale = 1.0 / max(norm, 1e-12)  # sentence-transformers' Normalize: F.normalize's eps
    return torch.tensor([x * scale for x in v], dtype=torch.float64).to(torch.float32).tolist()
