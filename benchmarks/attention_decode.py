"""One decode step's attention: the native paged-attention op alone, one layer, c sequences of a given context.

Shape of SmolLM2-1.7B by default (32 query and 32 KV heads of 64, blocks of 32 tokens); --kv-heads gives grouped-query
attention (Llama 3.1 8B: --heads 32 --kv-heads 8 --dim 128), whose kernel reads each kv head once for its query heads:
against --kv-heads equal to --heads (each query head with its own copy) the cache read per step shrinks by the group. Two placements of the
same amount of work: every sequence with its own blocks (c x context tokens of cache, read from memory as in a
server), and every sequence reading one shared set of blocks (one context's cache, which stays in L3): the gap
between them is what reaching memory costs, the second what the arithmetic costs. Each KV dtype the kernel reads.
Prints ms per layer, cycles per (sequence, head, key) at the given clock, the cache's GB/s, and torch.sum's read
bandwidth, and writes JSON.

    .venv/bin/python benchmarks/attention_decode.py [--seqs 16] [--context 140,1000] [--dtypes float32,float16]
        [--heads 32] [--kv-heads 32] [--dim 64] [--threads 2] [--ghz 3.6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from gguf_serving import read_bandwidth_gb_s
from peers import cpu_name
from steadyserve.kernels import load

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def one_layer_s(seqs: int, context: int, dtype: torch.dtype, shared: bool, heads: int, dim: int, bs: int,
                kv_heads: int) -> float:
    """Best of 10 calls of paged_attention for `seqs` decode tokens at position context - 1, in seconds."""
    per_seq = (context + bs - 1) // bs
    nb = (1 if shared else seqs) * per_seq
    k = torch.randn(nb, kv_heads, dim, bs).to(dtype)  # (NB, Hkv, D, Bs): kv_cache.py's layout
    v = torch.randn(nb, kv_heads, bs, dim).to(dtype)  # (NB, Hkv, Bs, D)
    tables = (torch.arange(per_seq).repeat(seqs, 1) if shared else torch.arange(nb).view(seqs, per_seq)).long()
    q, seq_of = torch.randn(seqs, heads, dim), torch.arange(seqs, dtype=torch.long)
    pos = torch.full((seqs,), context - 1, dtype=torch.long)
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        torch.ops.steadyserve.paged_attention(q, k, v, tables, seq_of, pos, out, dim ** -0.5, 0, 0.0)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", default="140,1000")
    p.add_argument("--dtypes", default="float32,float16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=0, help="kv heads (0: as many as --heads)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ghz", type=float, default=3.6, help="the clock the cycles per key are counted at")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if not load().available:
        raise SystemExit("native kernels not built")
    torch.set_num_threads(a.threads)
    cpu = cpu_name()
    kv_heads = a.kv_heads or a.heads
    rows = []
    for context in (int(c) for c in a.context.split(",")):
        for name in a.dtypes.split(","):
            dtype = DTYPES[name]
            for shared in (False, True):
                s = one_layer_s(a.seqs, context, dtype, shared, a.heads, a.dim, a.block, kv_heads)
                keys = a.seqs * a.heads * context  # (sequence, query head, key) triples
                cache_bytes = 2 * a.seqs * kv_heads * context * a.dim * torch.tensor([], dtype=dtype).element_size()
                row = {"context": context, "dtype": name, "shared_blocks": shared, "ms_per_layer": s * 1e3,
                       "cycles_per_key": s * a.threads * a.ghz * 1e9 / keys, "cache_gb_s": cache_bytes / s / 1e9}
                rows.append(row)
                where = "one shared cache (L3)" if shared else "own blocks (memory)"
                print(f"context {context:5d} {name:8s} {where:22s}: {row['ms_per_layer']:7.2f} ms per layer, "
                      f"{row['cycles_per_key']:5.0f} cycles per key at {a.ghz} GHz, {row['cache_gb_s']:5.1f} GB/s "
                      f"of cache", flush=True)
    bw = read_bandwidth_gb_s(a.threads)
    print(f"torch.sum read bandwidth, {a.threads} threads: {bw:.1f} GB/s; {cpu}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"cpu": cpu, "threads": a.threads, "seqs": a.seqs, "heads": a.heads,
                                     "kv_heads": kv_heads,
                                     "dim": a.dim, "block": a.block, "read_gb_s": bw, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
