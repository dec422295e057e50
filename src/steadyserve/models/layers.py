"""Numerics of the row-wise part of the forward pass, with and without batch invariance.

Why this file exists: a row of `F.linear` can change with the number of rows in
the call (MKL picks kernels by M). Row-wise work (norms, projections, RoPE, MLP,
LM head, log-softmax) therefore runs through `RowTiler`, in calls whose row
counts were verified at start-up to give every row the bits it gets in the
largest tile. Attention, the one step that mixes rows, lives in attention.py.

With `enabled=False` the same model runs each row-wise function once over all
rows: the plain path we measure the cost of invariance against, and what the
tests use to show they would catch drift.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Tensors = torch.Tensor | tuple[torch.Tensor, ...]


class RowTiler:
    """Runs a row-wise function in calls whose row counts come from a verified ladder.

    A row's result must not depend on how many other rows share its kernel call.
    MKL picks GEMM kernels by M; in its strict reproducibility mode (MKL_CBWR,
    set by steadyserve at import) rows agree for every M >= 4 on the machines
    seen so far, but that is an observation, not a promise. So `calibrate()`
    runs the real row-wise functions (norm + projections + RoPE, attention
    output + MLP, final norm, LM head + log-softmax) at each candidate row count
    and keeps the counts whose rows equal the largest tile's, bitwise. A call
    with n rows then runs at the smallest verified count >= n, zero-padded:
    with strict MKL that pads only n < 4; without it, up to the full tile.
    """

    def __init__(self, max_tile: int, enabled: bool) -> None:
        self.max_tile = max_tile
        self.enabled = enabled
        self.tiles = [max_tile]  # verified row counts, ascending; calibrate() may add smaller ones

    def candidate_tiles(self) -> list[int]:
        """Every count to 16, then steps of 4 to 64, of 16 to 256 and of 64 beyond: padding stays under 25%."""
        ladder = (set(range(1, 17)) | set(range(20, 65, 4)) | set(range(80, 257, 16))
                  | set(range(320, self.max_tile + 1, 64)))
        return sorted(t for t in ladder if t < self.max_tile) + [self.max_tile]

    def calibrate(self, fns: list[RowProbe], seed: int = 0) -> list[int]:
        """Keep the candidate counts whose rows equal the full tile's, bitwise, for every probe."""
        g = torch.Generator().manual_seed(seed)
        refs = []
        for fn, make_rows in fns:
            rows = make_rows(self.max_tile, g)
            refs.append((fn, rows, _as_tuple(fn(*rows))))
        ok = []
        for t in self.candidate_tiles():
            good = True
            for fn, rows, ref in refs:
                for start in sorted({0, self.max_tile - t}):  # two positions of the probe rows
                    out = _as_tuple(fn(*(r[start:start + t] for r in rows)))
                    if not all(torch.equal(o, r[start:start + t]) for o, r in zip(out, ref)):
                        good = False
                        break
                if not good:
                    break
            if good:
                ok.append(t)
        self.tiles = ok if self.max_tile in ok else [self.max_tile]
        return self.tiles

    def plan(self, n: int) -> list[int]:
        """Row counts of the calls covering n rows: full tiles, then the smallest verified count for the rest."""
        full, rest = divmod(n, self.max_tile)
        sizes = [self.max_tile] * full
        if rest:
            sizes.append(next(t for t in self.tiles if t >= rest))
        return sizes

    def __call__(self, fn: Callable[..., Tensors], *rows: torch.Tensor) -> Tensors:
        """Apply `fn` to `rows` (all with the same leading dim T) in verified row counts.

        `fn` must be row-wise: output row i depends only on input row i.
        """
        if not self.enabled:
            return fn(*rows)
        n = rows[0].shape[0]
        sizes = self.plan(n)
        pad = sum(sizes) - n
        if pad:
            rows = tuple(torch.cat([r, r.new_zeros((pad, *r.shape[1:]))]) for r in rows)
        if len(sizes) == 1:
            out = fn(*rows)
            return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]
        outs = []
        start = 0
        for size in sizes:
            outs.append(fn(*(r[start:start + size] for r in rows)))
            start += size
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts)[:n] for parts in zip(*outs))
        return torch.cat(outs)[:n]


# A row-wise function and a maker of random inputs for it: make_rows(n, generator) -> rows.
RowProbe = tuple[Callable[..., Tensors], Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]]


def _as_tuple(x: Tensors) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama computes it: in float32, scaled by weight in the model dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op; same bits as below on our CPUs
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos/sin: (T, D), rows looked up by absolute position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
