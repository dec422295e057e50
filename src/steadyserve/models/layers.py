"""Numerics of the forward pass, with and without batch invariance.

Why this file exists: on our CPUs a row of `F.linear` changes with the number of
rows in the call (MKL picks kernels by M), and attention differs between prefill
and decode (../shared/experiments/). So every reduction here runs in an order
that depends only on the row itself:

* Row-wise work (norms, projections, MLP, LM head, log-softmax) runs through
  `RowTiler`: every kernel call sees exactly `tile` rows, zero-padded. The GEMM
  shape never changes, so neither does the reduction order of any row.
* Attention (`attention_invariant`) runs one token at a time as a batch of
  fixed-shape GEMMs, over fixed KV blocks in a fixed order with an online
  softmax. A trailing fully-masked block is an exact no-op (scale 1, add 0),
  so prefill, chunked prefill and decode reduce over the same blocks.

With `enabled=False` the same model runs plain PyTorch (one GEMM over all rows,
SDPA attention): the baseline we measure the cost against and what the tests
use to show they would catch drift.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Tensors = torch.Tensor | tuple[torch.Tensor, ...]


class RowTiler:
    """Runs a row-wise function on tiles whose sizes come from a verified ladder.

    The kernel shape of a row must not depend on the other rows. One fixed tile
    (`max_tile` rows, zero-padded) guarantees that by construction but wastes
    work on small batches, so smaller tiles may be used for the remainder, but
    only sizes that `calibrate()` found to give bitwise the same rows as the
    full tile on this machine (MKL picks kernels by M; on our CPUs M in
    {1, 2, 3, 5} differ, while 4, 8, 16, 32 match 64).
    """

    def __init__(self, max_tile: int, enabled: bool) -> None:
        self.max_tile = max_tile
        self.enabled = enabled
        self.tiles = [max_tile]  # verified sizes, ascending; calibrate() may add smaller ones

    def candidate_tiles(self) -> list[int]:
        return [t for t in (4, 8, 16, 32, 64, 128, 256) if t < self.max_tile] + [self.max_tile]

    def calibrate(self, weights: list[torch.Tensor], seed: int = 0) -> list[int]:
        """Keep the candidate tile sizes whose GEMM rows equal the full tile's, bitwise."""
        g = torch.Generator().manual_seed(seed)
        ok = []
        for t in self.candidate_tiles():
            good = True
            for w in weights:
                x = torch.randn(self.max_tile, w.shape[1], generator=g).to(w.device, w.dtype)
                ref = F.linear(x, w)
                for start in sorted({0, self.max_tile - t}):  # two positions of the probe rows
                    if not torch.equal(F.linear(x[start:start + t], w), ref[start:start + t]):
                        good = False
            if good:
                ok.append(t)
        self.tiles = ok if self.max_tile in ok else [self.max_tile]
        return self.tiles

    def plan(self, n: int) -> list[int]:
        """Tile sizes covering n rows: full tiles, then the smallest verified tile for the rest."""
        full, rest = divmod(n, self.max_tile)
        sizes = [self.max_tile] * full
        if rest:
            sizes.append(next(t for t in self.tiles if t >= rest))
        return sizes

    def __call__(self, fn: Callable[..., Tensors], *rows: torch.Tensor) -> Tensors:
        """Apply `fn` to `rows` (all with the same leading dim T) tile by tile.

        `fn` must be row-wise: output row i depends only on input row i.
        """
        if not self.enabled:
            return fn(*rows)
        n = rows[0].shape[0]
        sizes = self.plan(n)
        pad = sum(sizes) - n
        if pad:
            rows = tuple(torch.cat([r, r.new_zeros((pad, *r.shape[1:]))]) for r in rows)
        outs = []
        start = 0
        for size in sizes:
            outs.append(fn(*(r[start:start + size] for r in rows)))
            start += size
        if len(outs) == 1:
            out = outs[0]
            return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts)[:n] for parts in zip(*outs))
        return torch.cat(outs)[:n]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama computes it: in float32, scaled by weight in the model dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos/sin: (T, D), rows looked up by absolute position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Store the new tokens' keys and values in their cache slots.

    k_cache: (NB, Hkv, D, Bs), keys stored transposed so a block is a GEMM operand as is.
    v_cache: (NB, Hkv, Bs, D). k, v: (T, Hkv, D). slot_*: (T,) block id and offset.
    """
    k_cache.permute(0, 3, 1, 2)[slot_blocks, slot_offsets] = k
    v_cache.permute(0, 2, 1, 3)[slot_blocks, slot_offsets] = v


def attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, positions: torch.Tensor, scale: float,
                        window: int = 0) -> torch.Tensor:
    """Causal attention of each token over its own sequence's cached keys.

    q: (T, H, D); block_tables: (T, NBmax), the block table of each token's
    sequence (padded with any valid block id); positions: (T,).
    Returns (T, H, D).

    Each token is its own GEMM batch entry of fixed shape (rep, D) x (D, Bs), so
    its result cannot depend on the other tokens, and the KV blocks are reduced in
    the same order whether the token came in prefill or decode.
    """
    t, h, d = q.shape
    nb, hkv, _, bs = k_cache.shape
    rep = h // hkv
    qg = (q * scale).reshape(t * hkv, rep, d)  # (T*Hkv, rep, D)
    m = q.new_full((t * hkv, rep, 1), float("-inf"))
    l = q.new_zeros((t * hkv, rep, 1))
    acc = q.new_zeros((t * hkv, rep, d))
    num_blocks = int(positions.max().item()) // bs + 1
    offsets = torch.arange(bs, device=q.device)
    for j in range(num_blocks):
        ids = block_tables[:, j]
        kb = k_cache.index_select(0, ids).view(t * hkv, d, bs)
        vb = v_cache.index_select(0, ids).view(t * hkv, bs, d)
        key_pos = j * bs + offsets  # (Bs,)
        masked = key_pos[None, :] > positions[:, None]  # (T, Bs)
        if window:
            masked |= key_pos[None, :] <= positions[:, None] - window
        s = torch.bmm(qg, kb).view(t, hkv * rep, bs)
        s = s.masked_fill(masked[:, None, :], float("-inf")).view(t * hkv, rep, bs)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # A row whose keys are all masked so far (only possible with a window)
        # keeps m = -inf; guard the exp against (-inf) - (-inf).
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, vb)
        m = m_new
    return (acc / l).view(t, h, d)


def attention_plain(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor, scale: float,
                    window: int = 0) -> torch.Tensor:
    """The usual way: gather each token's keys, one padded SDPA call. Not batch-invariant."""
    t, h, d = q.shape
    nb, hkv, _, bs = k_cache.shape
    num_blocks = int(positions.max().item()) // bs + 1
    tables = block_tables[:, :num_blocks]
    keys = k_cache[tables].permute(0, 2, 1, 4, 3).reshape(t, hkv, num_blocks * bs, d)
    values = v_cache[tables].permute(0, 2, 1, 3, 4).reshape(t, hkv, num_blocks * bs, d)
    key_pos = torch.arange(num_blocks * bs, device=q.device)
    allowed = key_pos[None, :] <= positions[:, None]
    if window:
        allowed &= key_pos[None, :] > positions[:, None] - window
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=allowed[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.view(t, h, d)
