"""Attention over the paged KV cache: the one step of the forward pass that mixes rows.

* `attention_native`: the C++ kernel (kernels/csrc/paged_attention.cpp). Each
  (token, kv head) reads its sequence's blocks in place and reduces keys in a
  fixed order of absolute positions, so prefill, chunked prefill and decode
  give identical bits, on any thread count and vector width. A prefill chunk's
  tokens share each block in tiles (one conversion of an f16/bf16/q8_0 block
  per tile, not per token) without changing any row's order. Used on both the
  invariant and the plain path when it is built.
* `attention_invariant`: the Python fallback when it is not. One token at a
  time as a batch of fixed-shape GEMMs over fixed KV blocks with an online
  softmax; a trailing fully-masked block is an exact no-op (scale 1, add 0).
  Invariant too, but not bitwise equal to the native kernel, and slower.
* `attention_plain`: gathers each token's keys for one padded SDPA call: the
  plain path's fallback, not batch-invariant.

The cache may be stored in another format than the activations (--kv-cache-dtype, engine/kv_cache.py): the
native kernel reads fp32, f16, bf16 and q8_0 caches, each value as the exact float it stores; the Python paths
read fp32, f16 and bf16 ones, upcast to the queries' dtype (exact), and refuse q8_0.

All take q: (T, H, D); k_cache: (NB, Hkv, D, Bs); v_cache: (NB, Hkv, Bs, D);
block_tables: (S, NBmax) int64, one row per sequence; seq_of: (T,) int64,
each token's row in block_tables; positions: (T,) int64; softcap > 0: Gemma 2's soft-capping of the
scaled scores, tanh(s / cap) * cap (0: none); sinks: (H,) float attention-sink logits (gpt-oss), one per query
head, each a key with no value that joins every row's softmax (None: none). They return (T, H, D).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels import kernel_status

# (q, k_cache, v_cache, block_tables, seq_of, positions, scale, window[, softcap]) -> (T, H, D)
AttentionFn = Callable[..., torch.Tensor]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Store the new tokens' keys and values in their cache slots.

    k_cache: (NB, Hkv, D, Bs), keys stored transposed so a block is a GEMM operand as is.
    v_cache: (NB, Hkv, Bs, D). k, v: (T, Hkv, D). slot_*: (T,) block id and offset.
    A cache in another format than k and v stores each value rounded (kernels/csrc/kv_format.h): by the native
    kernel wherever it is built, the one converter NativeLayers stores through too, so both forward paths store
    the same bytes; without it, f16 and bf16 by torch's casts (the same IEEE round to nearest even).
    """
    if k_cache.dtype != k.dtype:
        status = kernel_status()
        if status is not None and status.available:
            torch.ops.steadyserve.kv_write(k_cache, v_cache, k, v, slot_blocks, slot_offsets)
            return
        if k_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"a {k_cache.dtype} KV cache is written by the native kernels only")
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.permute(0, 3, 1, 2)[slot_blocks, slot_offsets] = k
    v_cache.permute(0, 2, 1, 3)[slot_blocks, slot_offsets] = v


def _readable(k_cache: torch.Tensor) -> None:
    """The Python paths read float caches only (upcast exactly); q8_0 is the native kernel's alone."""
    if not k_cache.dtype.is_floating_point:
        raise ValueError("a q8_0 KV cache is read by the native attention kernel only")


def attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_of: torch.Tensor, positions: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The C++ kernel (kernels/csrc/paged_attention.cpp): reads the paged cache in place.

    q: (T, H, D); block_tables: (S, NBmax), one row per sequence (padded with
    any valid block id); seq_of: (T,) each token's row in block_tables;
    positions: (T,). Returns (T, H, D). Its reduction order per output row is
    fixed by construction and documented in the source.
    """
    out = torch.empty_like(q)
    if sinks is not None:
        torch.ops.steadyserve.paged_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_of, positions, out,
                                              scale, window, softcap, sinks.float().contiguous())
    elif softcap:
        torch.ops.steadyserve.paged_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_of, positions, out,
                                              scale, window, softcap)
    else:  # the call as it always was
        torch.ops.steadyserve.paged_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_of, positions, out,
                                              scale, window)
    return out


def attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_of: torch.Tensor, positions: torch.Tensor, scale: float,
                        window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each token over its own sequence's cached keys (Python fallback).

    Same arguments as attention_native. Returns (T, H, D).

    Each token is its own GEMM batch entry of fixed shape (rep, D) x (D, Bs), so
    its result cannot depend on the other tokens, and the KV blocks are reduced in
    the same order whether the token came in prefill or decode.
    """
    _readable(k_cache)
    t, h, d = q.shape
    nb, hkv, _, bs = k_cache.shape
    rep = h // hkv
    block_tables = block_tables[seq_of]  # (T, NBmax)
    qg = (q * scale).reshape(t * hkv, rep, d)  # (T*Hkv, rep, D)
    m = q.new_full((t * hkv, rep, 1), float("-inf"))
    l = q.new_zeros((t * hkv, rep, 1))
    if sinks is not None:  # the sink is a key with no value: it starts the running max, with exp(0) = 1 in the sum
        m = sinks.to(q.dtype).view(1, hkv, rep, 1).expand(t, hkv, rep, 1).reshape(t * hkv, rep, 1).clone()
        l = torch.ones_like(m)
    acc = q.new_zeros((t * hkv, rep, d))
    num_blocks = int(positions.max().item()) // bs + 1
    offsets = torch.arange(bs, device=q.device)
    for j in range(num_blocks):
        ids = block_tables[:, j]
        kb = k_cache.index_select(0, ids).view(t * hkv, d, bs).to(q.dtype)
        vb = v_cache.index_select(0, ids).view(t * hkv, bs, d).to(q.dtype)
        key_pos = j * bs + offsets  # (Bs,)
        masked = key_pos[None, :] > positions[:, None]  # (T, Bs)
        if window:
            masked |= key_pos[None, :] <= positions[:, None] - window
        s = torch.bmm(qg, kb).view(t, hkv * rep, bs)
        if softcap:  # elementwise on a (T, H, Bs) tensor: Bs % 16 == 0 keeps every row in PyTorch's vector loop
            s = torch.tanh(s / softcap) * softcap
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


def attention_plain(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_of: torch.Tensor, positions: torch.Tensor, scale: float, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The usual way: gather each token's keys, one padded SDPA call. Not batch-invariant."""
    _readable(k_cache)
    t, h, d = q.shape
    nb, hkv, _, bs = k_cache.shape
    num_blocks = int(positions.max().item()) // bs + 1
    tables = block_tables[seq_of, :num_blocks]
    keys = k_cache[tables].permute(0, 2, 1, 4, 3).reshape(t, hkv, num_blocks * bs, d).to(q.dtype)
    values = v_cache[tables].permute(0, 2, 1, 3, 4).reshape(t, hkv, num_blocks * bs, d).to(q.dtype)
    key_pos = torch.arange(num_blocks * bs, device=q.device)
    allowed = key_pos[None, :] <= positions[:, None]
    if window:
        allowed &= key_pos[None, :] > positions[:, None] - window
    if softcap or sinks is not None:  # SDPA has neither soft-capping nor sinks: the scores by hand
        qg = q.view(t, hkv, h // hkv, d)
        s = torch.einsum("tgrd,tgkd->tgrk", qg, keys) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
        if sinks is None:
            return torch.einsum("tgrk,tgkd->tgrd", torch.softmax(s, dim=-1), values).reshape(t, h, d)
        sink = sinks.to(s.dtype).view(1, hkv, h // hkv, 1).expand(t, -1, -1, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share has no value
        return torch.einsum("tgrk,tgkd->tgrd", p, values).reshape(t, h, d)
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=allowed[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.view(t, h, d)
